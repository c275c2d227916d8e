"""Per test file: tests passed, failed, errored and skipped (the junit XML files run.sh writes).

    python docs/benchmarks/vllm_tests/summarize.py /tmp/pagoda-vllm-tests/results
"""

import glob
import sys
import xml.etree.ElementTree as ET

totals = dict.fromkeys(("passed", "failed", "error", "skipped"), 0)
for path in sorted(glob.glob(f"{sys.argv[1] if len(sys.argv) > 1 else 'results'}/*.xml")):
    root = ET.parse(path).getroot()
    suite = root if root.tag == "testsuite" else root.find("testsuite")
    counts = dict.fromkeys(totals, 0)
    for case in suite.iter("testcase"):
        tags = {child.tag for child in case}
        kind = "failed" if "failure" in tags else "error" if "error" in tags else "skipped" if "skipped" in tags else "passed"
        counts[kind] += 1
    totals = {k: totals[k] + counts[k] for k in totals}
    print(f"{path.split('/')[-1][:-4]:50s} " + " ".join(f"{k} {v:3d}" for k, v in counts.items()))
print(f"{'total':50s} " + " ".join(f"{k} {v:3d}" for k, v in totals.items()))
