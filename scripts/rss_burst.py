"""RSS of a pagoda server before and after a burst of large requests (A/B: malloc_trim on/off)."""
import subprocess, sys, time, httpx, json, concurrent.futures as cf
trim = sys.argv[1] == "on"
port = 8321
code = ("import pagoda.heap as h\n" + ("" if trim else "h.trim = lambda: False\n") +
        "import sys; from pagoda.cli import main; sys.argv=['pagoda','serve','smollm2','--port','%d','--uvicorn-log-level','warning','--disable-log-stats']; sys.exit(main())" % port)
p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
def rss():
    for l in open(f"/proc/{p.pid}/status"):
        if l.startswith("VmRSS"): return int(l.split()[1]) // 1024
url = f"http://127.0.0.1:{port}"
for _ in range(300):
    try:
        if httpx.get(url + "/health").status_code == 200: break
    except Exception: pass
    time.sleep(0.5)
time.sleep(3); base = rss()
words = "lorem ipsum dolor sit amet consectetur " * 6000  # ~234k chars, ~ 48k tokens: refused after tokenizing
valid = "the quick brown fox jumps over the lazy dog " * 700    # ~6.3k tokens: runs
def send(i):
    body = {"prompt": words if i % 2 else valid, "max_tokens": 4}
    return httpx.post(url + "/v1/completions", json=body, timeout=600).status_code
out = {"trim": trim, "rss_base_mb": base}
with cf.ThreadPoolExecutor(8) as ex:
    codes = list(ex.map(send, range(1, 48, 2)))  # refused after tokenizing
out["refused_codes"] = sorted(set(codes)); out["after_refused_mb"] = rss(); time.sleep(4); out["idle_after_refused_mb"] = rss()
with cf.ThreadPoolExecutor(8) as ex:
    codes = list(ex.map(send, range(0, 48, 2)))  # valid long prompts
out["valid_codes"] = sorted(set(codes)); out["after_valid_mb"] = rss(); time.sleep(4); out["idle_after_valid_mb"] = rss()
big = httpx.post(url + "/v1/completions", content=b'{"prompt": "' + b"x" * 50_000_000 + b'"}', headers={"Content-Type": "application/json"}, timeout=600)
out["50MB_prompt"] = big.status_code; time.sleep(2); out["idle_after_50MB_mb"] = rss()
print(json.dumps(out))
p.terminate(); p.wait()
