"""Reads the zdelay console's sink table in a headless chromium (selenium + Debian's
chromedriver), for tests that check what an operator sees of a sink.

  console_sinks.py BASE_URL

BASE_URL is the console's root, ending with "/". Prints one JSON document on stdout:
{"<sink>": {"health": "<the health cell's first line>", "held": ["<target>", ...]}, ...}
"""
import json
import sys

from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import WebDriverWait

from chromium import headless

base = sys.argv[1]
driver = headless()
try:
    driver.get(base + "#overview")
    WebDriverWait(driver, 20).until(
        lambda d: d.find_elements(By.CSS_SELECTOR, "tr[data-sink]"))
    sinks = {}
    for row in driver.find_elements(By.CSS_SELECTOR, "tr[data-sink]"):
        health = row.find_elements(By.CSS_SELECTOR, "td")[2]
        sinks[row.get_attribute("data-sink")] = {
            "health": health.find_element(By.CSS_SELECTOR, "span").text,
            "held": [h.get_attribute("data-held")
                     for h in health.find_elements(By.CSS_SELECTOR, "[data-held]")],
        }
    print(json.dumps(sinks))
finally:
    driver.quit()
