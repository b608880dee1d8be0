"""Loads the console's schedules page in a headless chromium and reports what schedule
SCHEDULE_ID's calendar cell shows: its summary line and each coming skip.

  console_calendar.py BASE_URL SCHEDULE_ID [SHOT_PNG]

Prints one JSON document: {"calendar": <summary>, "skips": [<text>...]}.
"""
import json
import sys

from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import WebDriverWait

from chromium import headless

base, schedule_id = sys.argv[1:3]
shot = sys.argv[3] if len(sys.argv) > 3 else None
driver = headless()
try:
    driver.get(base + "#schedules")
    cell = f'tr[data-schedule="{schedule_id}"] td[data-calendar]'
    WebDriverWait(driver, 20).until(lambda d: d.find_elements(By.CSS_SELECTOR, cell))
    td = driver.find_element(By.CSS_SELECTOR, cell)
    report = {
        "calendar": td.find_element(By.CSS_SELECTOR, "div").text,
        "skips": [e.text for e in td.find_elements(By.CSS_SELECTOR, "div[data-skip]")],
    }
    if shot:
        driver.save_screenshot(shot)
    print(json.dumps(report))
finally:
    driver.quit()
