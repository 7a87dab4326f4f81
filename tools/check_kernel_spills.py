#!/usr/bin/env python3
"""Guards the Hopper prefill kernel's register allocation: recompiles one CUDA source of the
build with `-Xptxas -v` (its exact command from the build's compile_commands.json) and fails
when a kernel instance whose mangled name contains PATTERN spills more than MAX_BYTES bytes
(spill stores). A change in the consumer's epilogue once made ptxas spill in the block loop
(8 -> 116 bytes, +13% cycles at 1 x 16384; bench/NOTES.md, eighteenth session): this catches
that on a machine without a GPU.

    python3 tools/check_kernel_spills.py BUILD_DIR SOURCE PATTERN MAX_BYTES
    e.g. python3 tools/check_kernel_spills.py build src/cuda/kernels/prefill_sm90_hd128.cu \\
           Li128ELi128ELi2E 16
"""
import json
import os
import re
import shlex
import subprocess
import sys


def main() -> int:
    build_dir, source, pattern, max_bytes = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    entries = json.load(open(os.path.join(build_dir, "compile_commands.json")))
    wanted = os.path.normpath(source)
    entry = next((e for e in entries if os.path.normpath(e["file"]).endswith(wanted)), None)
    if entry is None:
        print(f"{source}: not in {build_dir}/compile_commands.json")
        return 1
    args = entry["arguments"] if "arguments" in entry else shlex.split(entry["command"])
    command, skip = [], 0
    for a in args:  # the build's command without its output and dependency-file options
        if skip:
            skip -= 1
        elif a in ("-o", "-MT", "-MF"):
            skip = 1
        elif a != "-MD":
            command.append(a)
    command += ["-o", os.devnull, "-Xptxas", "-v"]
    run = subprocess.run(command, cwd=entry["directory"], capture_output=True, text=True)
    log = run.stdout + run.stderr
    if run.returncode != 0:
        print(log)
        return 1
    seen = bad = 0
    name = ""
    for line in log.splitlines():
        m = re.search(r"Compiling entry function '([^']+)'", line)
        if m:
            name = m.group(1)
            continue
        m = re.search(r"(\d+) bytes spill stores", line)
        if m and pattern in name:
            stores = int(m.group(1))
            print(f"{name}: {stores} bytes spill stores (at most {max_bytes})")
            seen += 1
            bad += stores > max_bytes
    if seen == 0:
        print(f"no kernel instance contains {pattern}")
        return 1
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
