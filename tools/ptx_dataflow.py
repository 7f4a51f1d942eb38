"""tools/ptx_dataflow.py: does a kernel refactor keep every kernel's floating-point arithmetic? A
CPU check (nvcc, no GPU) to run before the bit-for-bit one on a GPU (tools/kernel_digest.py).

    python3 tools/ptx_dataflow.py 664813a HEAD            # every kernels/*.cu, every head dim
    python3 tools/ptx_dataflow.py 664813a WORKTREE --sources attention.cu --head-dims 64

Builds the PTX of every instance (QP_INSTANTIATE_ALL, sm_90) of the kernels of two trees (a commit,
or WORKTREE for the files on disk) and compares each instance, matched by name up to its
parameter list, by the dataflow of its floating-point arithmetic. Every instruction with a
floating-point type (add, fma, ex2, selp.f32, setp.f32, cvt, mma, ...) gets a value number from
its opcode, immediates and operands' value numbers; a float load is its opcode (space and type,
address aside), a store its value; integer and address arithmetic, parameter loads and copies are
opaque. Register names, the order of independent instructions and the operand order of a
commutative operation (IEEE add, mul, min, max, fma's product: exact under swapping) do not
count; a changed operation, constant, contraction or operand does. "Same values, a repeat count
changed": the same value numbers, one computed more or fewer times (a select nvcc hoists or not).
Also prints the count of read-only loads (ld.global.nc) of each build. Exit 1 on any other
difference.
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import hashlib
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
REG = re.compile(r"%[a-z_]+\d+")
FP_TYPE = re.compile(r"\.(f32|f16|bf16|f64|f16x2|bf16x2|e4m3x2|approx|ftz|rn|rz|rm|rp)\b")
NO_DEST = ("st.", "bar", "bra", "ret", "exit", "cp.async", "membar", "fence", "griddepcontrol",
           "red.", "prefetch", "trap", "call", "barrier")
COMMUTATIVE = ("add.f", "mul.f", "max.f", "min.f", "fma.", "add.rn.f", "mul.rn.f")
HEAD_DIMS = (64, 80, 96, 128, 192, 256)


def _tree(rev: str, out: Path) -> Path:
    """kernels/ of commit `rev` (or the work tree) under out."""
    if rev == "WORKTREE":
        return ROOT / "kernels"
    out.mkdir(parents=True)
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", rev, "kernels"],
                             capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(out)], input=archive, check=True)
    return out / "kernels"


def _ptx(kernels: Path, source: str, dim: int, out: Path) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    ptx = out / f"{source}.{dim}.ptx"
    cmd = ["nvcc", "-arch=sm_90", "-std=c++17", f"-I{kernels}", "-DQP_INSTANTIATE_ALL",
           f"-DQP_INSTANTIATE_HEAD_DIM={dim}", "-ptx", str(kernels / source), "-o", str(ptx)]
    subprocess.run(cmd, check=True)
    return ptx


def entries(path: Path) -> dict[str, list[str]]:
    """Kernel instance (mangled name up to its parameter list) -> its PTX lines."""
    out, name, body = {}, None, []
    for line in path.read_text().splitlines():
        m = re.match(r"\s*\.(visible |weak )?\.entry (\S+)\(", line)
        if m:
            if name:
                out[re.split(r"Ev", name, 1)[0]] = body
            name, body = m.group(2), []
        elif name is not None:
            body.append(line.strip())
    if name:
        out[re.split(r"Ev", name, 1)[0]] = body
    return out


def _operands(text: str) -> list[str]:
    ops, depth, cur = [], 0, ""
    for ch in text:
        if ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
        if ch == "," and depth == 0:
            ops.append(cur.strip())
            cur = ""
        else:
            cur += ch
    return ops + ([cur.strip()] if cur.strip() else [])


def _h(*parts) -> str:
    return hashlib.sha1(repr(parts).encode()).hexdigest()[:16]


def flow(body: list[str]) -> collections.Counter:
    """Multiset of the value numbers of the floating-point instructions and stores of a body."""
    val, out = {}, collections.Counter()

    def look(text):
        return REG.sub(lambda m: val.get(m.group(0), "int"), text)

    for line in body:
        if not line.endswith(";") or line.startswith("."):
            continue
        line, guard = line[:-1], ""
        if line.startswith("@"):
            guard, line = line.split(None, 1)
        opcode, _, rest = line.partition(" ")
        ops = _operands(rest.strip())
        dest = not opcode.startswith(NO_DEST) and bool(ops)
        dregs, srcs = (REG.findall(ops[0]), ops[1:]) if dest else ([], ops)
        fp = bool(FP_TYPE.search(opcode)) or any(r.startswith(("%f", "%fd")) for r in dregs) \
            or opcode.startswith(("mma", "ex2", "lg2", "rcp", "sqrt"))
        if opcode.startswith("st."):
            out[_h("st", re.sub(r"\.[su]32", ".b32", opcode), look(srcs[-1]))] += 1
            continue
        if opcode.startswith("mov.") and len(srcs) == 1 and REG.fullmatch(srcs[0]):
            for r in dregs:  # a copy: the value it copies
                val[r] = val.get(srcs[0], "int")
            continue
        if opcode.startswith("ld."):
            key = _h("ld", opcode) if fp else "int"
        elif opcode.startswith("mov.") and len(srcs) == 1 and fp and not REG.search(srcs[0]) \
                and not srcs[0].startswith("_"):
            key = _h("imm", srcs[0])
        elif fp:
            args = tuple(look(o) if REG.search(o) else o for o in srcs)
            if opcode.startswith(COMMUTATIVE) and len(args) >= 2:
                args = tuple(sorted(args[:2])) + args[2:]
            key = _h(look(guard), opcode, args)
            out[key] += 1
        else:
            key = "int"
        for i, r in enumerate(dregs):
            val[r] = key if key == "int" else _h(key, i)
    return out


def compare(old: Path, new: Path) -> tuple[int, int, int, list[str]]:
    """(instances, same dataflow, same values with a repeat count changed, others' names)."""
    a, b = entries(old), entries(new)
    if a.keys() != b.keys():
        return len(a), 0, 0, sorted(set(a) ^ set(b))
    same = repeat = 0
    others = []
    for k in a:
        fa, fb = flow(a[k]), flow(b[k])
        if fa == fb:
            same += 1
        elif set(fa) == set(fb):
            repeat += 1
        else:
            others.append(k)
    return len(a), same, repeat, others


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="tools/ptx_dataflow.py", description=__doc__.split("\n")[0])
    ap.add_argument("old", help="commit of the kernels before (or WORKTREE)")
    ap.add_argument("new", help="commit of the kernels after (or WORKTREE)")
    ap.add_argument("--sources", nargs="*", help="kernels/*.cu to compare (default: all)")
    ap.add_argument("--head-dims", nargs="*", type=int, default=list(HEAD_DIMS),
                    help="head dims of the sources that instantiate per head dim")
    args = ap.parse_args(argv)
    sources = args.sources or sorted(p.name for p in (ROOT / "kernels").glob("*.cu"))
    bad = 0
    with tempfile.TemporaryDirectory() as tmp:
        trees = [_tree(rev, Path(tmp) / f"t{i}") for i, rev in enumerate((args.old, args.new))]
        jobs = [(s, d) for s in sources if s != "ceilings.cu"
                for d in (args.head_dims if s in ("attention.cu", "estimate.cu") else (0,))]
        with concurrent.futures.ThreadPoolExecutor(os.cpu_count() or 2) as pool:
            ptx = {(i, s, d): pool.submit(_ptx, t, s, d, Path(tmp) / f"t{i}")
                   for i, t in enumerate(trees) for s, d in jobs}
            for s, d in jobs:
                old, new = ptx[(0, s, d)].result(), ptx[(1, s, d)].result()
                n, same, repeat, others = compare(old, new)
                nc = [p.read_text().count("ld.global.nc") for p in (old, new)]
                print(f"{s} d {d or 'all'}: {n} instances, {same} same dataflow, {repeat} same "
                      f"values with a repeat count changed, {len(others)} other; "
                      f"ld.global.nc {nc[0]} -> {nc[1]}")
                for k in others[:8]:
                    print(f"  differs: {k}")
                bad += len(others)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
