"""Reads the console's flow-control tables in a headless chromium (selenium + Debian's
chromedriver), for tests/it/flow.rs to check against the config and Redis.

  console_flow.py BASE_URL [SHOTS_DIR]

Loads the overview and reads each row of its "Flow control" table; loads the forecast and
reads each row of its "Rate-limited routes" table. Prints one JSON document on stdout:
{"flow": {route: [cells]}, "limits": {route: [cells]}}.
"""
import json
import os
import sys

from selenium.webdriver.common.by import By
from selenium.webdriver.support import expected_conditions as EC
from selenium.webdriver.support.ui import WebDriverWait

from chromium import headless

base = sys.argv[1]
shots = sys.argv[2] if len(sys.argv) > 2 else None
driver = headless()
wait = WebDriverWait(driver, 20)


def rows(page, table, key):
    driver.get(base + "#" + page)
    wait.until(EC.presence_of_element_located((By.CSS_SELECTOR, f"#{table} tbody tr")))
    if shots:
        os.makedirs(shots, exist_ok=True)
        driver.save_screenshot(os.path.join(shots, f"{page}-{table}.png"))
    out = {}
    for tr in driver.find_elements(By.CSS_SELECTOR, f"#{table} tbody tr"):
        out[tr.get_attribute(key)] = [td.text for td in tr.find_elements(By.TAG_NAME, "td")]
    return out


try:
    report = {"flow": rows("overview", "flow", "data-flow"),
              "limits": rows("forecast", "route-limits", "data-limit")}
finally:
    driver.quit()
print(json.dumps(report))
