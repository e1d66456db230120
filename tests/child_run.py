"""generate in a child process, then what it holds after its run, as one JSON line: its exit code, its peak RSS
(VmHWM), its modules and the LLVM library's resident bytes (/proc/self/smaps). Run as
`python -c GENERATE_REPORT generate ARGS...` (tests/test_process_base.py, tests/test_gguf_mapped.py)."""

GENERATE_REPORT = """
import json, re, sys
from flashinfer_lite.cli import main
from flashinfer_lite.process import peak_rss_bytes
rc = main(sys.argv[1:])
llvm, inside = 0, False
for line in open("/proc/self/smaps"):
    if re.match(r"[0-9a-f]+-[0-9a-f]+ ", line):
        inside = "libllvmlite" in line
    elif inside and line.startswith("Rss:"):
        llvm += int(line.split()[1]) << 10
print(json.dumps({"rc": rc, "peak": peak_rss_bytes(), "modules": sorted(sys.modules), "llvm_rss": llvm}))
"""
