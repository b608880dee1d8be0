"""Drives the zdelay console in a headless chromium (selenium + Debian's chromedriver) and
reports what each page shows, for tests/it/console.rs to check against Redis.

  console_browser.py BASE_URL TOKEN JOB_ID DEAD_REPLAY_ID DEAD_REFUSED_ID SCHEDULE_ID
                     FILTER_ROUTE HISTORY_ID [SHOTS_DIR]

BASE_URL ends with "/" (the console's root, under its prefix). The script:
  1. loads the public pages (overview, forecast, schedules) and reads the numbers and ids
     they show;
  2. without a token: sees the action buttons disabled, sees the dead letters refused (they
     show payloads: the page asks for the token), and POSTs a replay of DEAD_REFUSED_ID from
     the page's own origin (fetch, as a forged click would): the server's status is
     reported;
  3. unlocks with TOKEN, then reads the dead letters and one job; filters the dead letters
     by FILTER_ROUTE in the page, reads the ids shown, opens HISTORY_ID's detail and reads
     its history lines (earlier deaths), clears the filter;
  4. clicks "Replay" on DEAD_REPLAY_ID's row, then reports the status line.
With SHOTS_DIR, saves a screenshot of each page there (<page>.png). Prints one JSON
document on stdout.
"""
import json
import os
import sys

from selenium.webdriver.common.by import By
from selenium.webdriver.support import expected_conditions as EC
from selenium.webdriver.support.ui import WebDriverWait

from chromium import headless

base, token, job_id, replay_id, refused_id, schedule_id, filter_route, history_id = sys.argv[1:9]
shots = sys.argv[9] if len(sys.argv) > 9 else None

driver = headless()
wait = WebDriverWait(driver, 20)
report = {}


def texts(selector, attr=None):
    found = driver.find_elements(By.CSS_SELECTOR, selector)
    return [e.get_attribute(attr) if attr else e.text for e in found]


def load(page, ready_selector):
    """Opens a page and waits until it rendered (the loaded marker changed) and shows
    `ready_selector`."""
    before = driver.execute_script(
        "const m = document.getElementById('page'); return m ? m.dataset.loadedAt || '' : ''")
    driver.get(base + "#" + page)
    wait.until(lambda d: d.execute_script(
        "const m = document.getElementById('page');"
        "return m && m.dataset.loadedAt && m.dataset.loadedAt !== arguments[0];", before))
    wait.until(EC.presence_of_element_located((By.CSS_SELECTOR, ready_selector)))
    status = driver.find_element(By.ID, "status")
    if "error" in (status.get_attribute("class") or ""):
        raise SystemExit(f"{page}: the page reports an error: {status.text}")


def rerender(action):
    """Runs `action` (a click that re-renders the current page) and waits until it did."""
    before = driver.execute_script("return document.getElementById('page').dataset.loadedAt")
    action()
    wait.until(lambda d: d.execute_script(
        "return document.getElementById('page').dataset.loadedAt !== arguments[0];", before))


def shot(name):
    if shots:
        os.makedirs(shots, exist_ok=True)
        driver.save_screenshot(os.path.join(shots, name + ".png"))


try:
    load("overview", "#total-scheduled")
    report["overview"] = {
        "due": int(driver.find_element(By.ID, "total-due").text),
        "scheduled": int(driver.find_element(By.ID, "total-scheduled").text),
        "dead": int(driver.find_element(By.ID, "total-dead").text),
        "instances": texts("tr[data-instance]", "data-instance"),
        "backlog_rows": texts("tr[data-backlog]", "data-backlog"),
        "rate": driver.find_element(By.ID, "rate").text,
        "lateness": driver.find_element(By.ID, "lateness").text,
    }
    shot("overview")

    load("forecast", "#forecast-steps")
    report["forecast"] = {
        "overdue": int(driver.find_element(By.ID, "forecast-overdue").text),
        "counts": [int(c) for c in texts("#forecast-steps td[data-count]", "data-count")],
        "bars": len(driver.find_elements(By.CSS_SELECTOR, "#forecast-chart rect.bar")),
        "spike_bars": len(driver.find_elements(By.CSS_SELECTOR, "#forecast-chart rect.spike")),
        "spikes": int(driver.find_element(By.ID, "forecast-spikes").text),
        "drain": int(driver.find_element(By.ID, "forecast-drain").text),
    }
    shot("forecast")

    load("schedules", "tr[data-schedule]")
    report["schedules"] = {
        "ids": texts("tr[data-schedule]", "data-schedule"),
        "row": driver.find_element(By.CSS_SELECTOR,
                                   f'tr[data-schedule="{schedule_id}"]').text,
        "health": driver.find_element(By.CSS_SELECTOR,
                                      f'tr[data-schedule="{schedule_id}"] td[data-health]')
        .get_attribute("data-health"),
    }
    report["buttons_disabled_without_token"] = all(
        not b.is_enabled() for b in driver.find_elements(By.CSS_SELECTOR, "button[data-action]"))
    shot("schedules")

    # Dead letters show payloads: without the token the page says what it needs.
    load("dead", "#needs-token")
    report["dead_locked"] = driver.find_element(By.ID, "needs-token").text
    # A forged action from the page's own origin, without the token: the server decides.
    report["refused_status"] = driver.execute_async_script(
        "const done = arguments[arguments.length - 1];"
        "fetch('api/dead/' + encodeURIComponent(arguments[0]) + '/replay', {method: 'POST'})"
        ".then(r => done(r.status), e => done(String(e)));", refused_id)

    # Unlock with the token (kept in sessionStorage): reads send it from now on, and the
    # page shows the dead letters it refused a moment ago.
    driver.find_element(By.ID, "token").send_keys(token)
    driver.find_element(By.ID, "unlock").click()
    wait.until(EC.text_to_be_present_in_element((By.ID, "auth-state"), "unlocked"))
    wait.until(EC.presence_of_element_located((By.ID, "dead-total")))
    report["token_in_page_html"] = token in driver.page_source
    report["dead"] = {
        "ids": texts("tr[data-dead]", "data-dead"),
        "total": int(driver.find_element(By.ID, "dead-total").get_attribute("data-total")),
        "raw_rows": texts("tr[data-raw]", "data-raw"),
    }
    shot("dead")

    # Filter by route in the page, then open one job's detail with its history.
    route_input = driver.find_element(By.ID, "dead-route")
    route_input.clear()
    route_input.send_keys(filter_route)
    rerender(lambda: driver.find_element(By.ID, "dead-filter").click())
    report["dead_filtered"] = {"ids": texts("tr[data-dead]", "data-dead")}
    shot("dead-filtered")
    rerender(lambda: driver.find_element(
        By.CSS_SELECTOR, f'tr[data-dead="{history_id}"] a').click())
    wait.until(EC.presence_of_element_located((By.ID, "dead-detail")))
    fields = {e.find_element(By.XPATH, "preceding-sibling::dt[1]").text: e.text
              for e in driver.find_elements(By.CSS_SELECTOR, "#dead-detail dd")}
    report["dead_detail"] = {"fields": fields, "history": texts("#dead-history li")}
    shot("dead-detail")
    load("dead", "#dead-route")
    driver.find_element(By.ID, "dead-route").clear()
    rerender(lambda: driver.find_element(By.ID, "dead-filter").click())

    load("job/" + job_id, "#job")
    fields = {e.find_element(By.XPATH, "preceding-sibling::dt[1]").text: e.text
              for e in driver.find_elements(By.CSS_SELECTOR, "#job dd")}
    report["job"] = {"fields": fields, "payload": driver.find_element(By.ID, "job-payload").text}
    shot("job")

    # Replay from the dead page.
    load("dead", f'tr[data-dead="{replay_id}"]')
    button = driver.find_element(
        By.CSS_SELECTOR, f'tr[data-dead="{replay_id}"] button[data-action="replay"]')
    wait.until(lambda d: button.is_enabled())
    button.click()
    wait.until(EC.text_to_be_present_in_element((By.ID, "status"), "replay"))
    report["replay_status"] = driver.find_element(By.ID, "status").text
    report["replay_status_class"] = driver.find_element(By.ID, "status").get_attribute("class")
finally:
    driver.quit()

print(json.dumps(report))
