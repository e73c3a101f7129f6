#!/usr/bin/env python3
"""Summarises a dhat-rs heap profile (`BENCH_DHAT=FILE make bench`): the allocation sites that
held the most bytes at the global peak, and those that allocated the most in total, each named
by its first frames outside the allocator, the standard library and dhat itself.

    bench/heap-summary.py dhat-heap.json [TOP]
"""
import json
import re
import sys

SKIP = re.compile(
    r"^(dhat::|alloc::|core::|std::|<alloc::|<core::|<std::|__rust|\[root\]|hashbrown::raw|"
    r"<hashbrown::|<dhat::|rust_begin|_start|__libc|main$)"
)


def function(frame: str) -> str:
    # "0x55d...: kube_runtime::watcher::step (src/watcher.rs:123:5)" -> the function (and line)
    text = frame.split(": ", 1)[-1]
    return re.sub(r"::h[0-9a-f]{16}", "", text)


def site(profile, pp, depth=3):
    names = [function(profile["ftbl"][i]) for i in pp["fs"]]
    ours = [n for n in names if not SKIP.match(n)]
    return " <- ".join(ours[:depth]) or " <- ".join(names[:depth])


def mib(n):
    return f"{n / 1048576:.2f}"


def table(profile, key, count_key, title, top):
    pps = sorted(profile["pps"], key=lambda p: p.get(key, 0), reverse=True)[:top]
    total = sum(p.get(key, 0) for p in profile["pps"])
    print(f"\n{title} (total {mib(total)} MiB)\n")
    print("| MiB | blocks | site (first frames outside alloc/std) |")
    print("|---|---|---|")
    for p in pps:
        print(f"| {mib(p.get(key, 0))} | {p.get(count_key, 0)} | `{site(profile, p)}` |")


def main():
    path = sys.argv[1]
    top = int(sys.argv[2]) if len(sys.argv) > 2 else 12
    with open(path) as f:
        profile = json.load(f)
    print(f"dhat profile {path}: {profile.get('cmd', '')}")
    table(profile, "gb", "gbk", "Live at the global peak (t-gmax)", top)
    table(profile, "eb", "ebk", "Live at exit (t-end)", top)
    table(profile, "tb", "tbk", "Allocated in total over the run", top)


if __name__ == "__main__":
    main()
