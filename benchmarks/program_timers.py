"""Per-program start / end times of the narrow decode kernel (attention/paged_decode_narrow.py) on the GPU.

A copy of the kernel's module, with `%globaltimer` / `%clock64` / `%smid` read at each program's start and
end and written to a buffer, replaces the module's functions in this process only; one step of each case
then runs, and the spread of starts, durations and ends is printed (quantiles in us), with the programs per
SM and each SM's last end. It answers where a launch's time goes between its first and last program: the
launch ramp, the programs' own durations, the tail. The copy is made by text edits of the module's source,
so a change to the kernel's signature or launch call that they no longer match fails loudly here.

PYTHONPATH=src python benchmarks/program_timers.py [--cases turboquant_4bit_nc:1x131072,tq3:32x32768]
(twenty-sixth session, H100: docs/benchmarks.md, "Per-program timers")
"""

from __future__ import annotations

import argparse
import linecache
import tempfile

import torch

from tqserve.attention import paged_decode_narrow as narrow
from tqserve.bench import kernels
from tqserve.bench.kernels import Case, _bench

# the asm texts stay inline in the calls: Triton wants a constant string there, not a local variable
PROBES = """
@triton.jit
def _probe_gt(x):
    return tl.inline_asm_elementwise(
        "mov.u64 $0, %globaltimer; // $1", "=l,r", [x], dtype=tl.int64, is_pure=False, pack=1
    )


@triton.jit
def _probe_clk(x):
    return tl.inline_asm_elementwise("mov.u64 $0, %clock64; // $1", "=l,r", [x], dtype=tl.int64, is_pure=False, pack=1)


@triton.jit
def _probe_sm(x):
    return tl.inline_asm_elementwise("mov.u32 $0, %smid; // $1", "=r,r", [x], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _probe_end(tim_ptr, pid_rh, pid_s, t_start, c_start):
    t_end = _probe_gt(pid_s)
    c_end = _probe_clk(pid_s)
    idx = (pid_rh * tl.num_programs(1) + pid_s).to(tl.int64) * 4
    tl.store(tim_ptr + idx, t_start)
    tl.store(tim_ptr + idx + 1, t_end)
    tl.store(tim_ptr + idx + 2, c_end - c_start)
    tl.store(tim_ptr + idx + 3, _probe_sm(pid_s).to(tl.int64))


"""


def _edit(src: str, old: str, new: str) -> str:
    if src.count(old) != 1:
        raise RuntimeError(f"the kernel's source no longer has one {old!r}: update program_timers.py")
    return src.replace(old, new)


def instrument() -> None:
    """Replace the narrow module's kernel and launcher with timed copies (this process only)."""
    src = open(narrow.__file__).read()
    src = _edit(src, "r_ptr, vr_ptr, h_ptr,\n    stride_qt,", "r_ptr, vr_ptr, h_ptr, tim_ptr,\n    stride_qt,")
    src = _edit(
        src,
        "    pid_s = tl.program_id(1)\n    req = pid_rh // HKV\n",
        "    pid_s = tl.program_id(1)\n    t_start = _probe_gt(pid_s)\n    c_start = _probe_clk(pid_s)\n"
        "    req = pid_rh // HKV\n",
    )
    end = src.index("\n\ndef launch(")  # the kernel's body ends there
    src = src[:end] + "\n    _probe_end(tim_ptr, pid_rh, pid_s, t_start, c_start)" + src[end:]
    src = _edit(src, "htab if htab is not None else qx,\n", "htab if htab is not None else qx, TIMBUF,\n")
    kernel_def = '@triton.jit(do_not_specialize=["stride_ls"])\ndef _narrow_decode_kernel'
    src = _edit(src, kernel_def, PROBES + kernel_def)
    # Triton reads a kernel's source through linecache: the copy needs a file of its own
    path = tempfile.NamedTemporaryFile("w", suffix="_narrow_timed.py", delete=False).name
    open(path, "w").write(src)
    linecache.cache[path] = (len(src), None, src.splitlines(True), path)
    exec(compile(src, path, "exec"), narrow.__dict__)


def quantiles(x: torch.Tensor) -> str:
    q = torch.tensor([0, 0.1, 0.5, 0.9, 0.99, 1.0], dtype=torch.float64)
    return " ".join(f"{v:.2f}" for v in torch.quantile(x.double(), q).tolist())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", default="turboquant_4bit_nc:1x131072,tq3:1x131072,turboquant_4bit_nc:32x32768")
    args = ap.parse_args()
    dev = torch.device("cuda")
    instrument()
    narrow.TIMBUF = torch.zeros(1 << 16, 4, dtype=torch.int64, device=dev)
    kernels.GRAPHS = True
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    for spec in args.cases.split(","):
        preset, shape = spec.split(":")
        n, ctx = (int(v) for v in shape.split("x"))
        case = Case(preset, n, ctx, 1, 32, 8, 128, dev)
        ms = _bench(case.run)
        narrow.TIMBUF.zero_()
        case.run()
        torch.cuda.synchronize()
        t = narrow.TIMBUF.cpu()
        t = t[t[:, 1] > 0]
        t0 = t[:, 0].min()
        dur = (t[:, 1] - t[:, 0]) / 1e3
        ends = (t[:, 1] - t0) / 1e3
        per_sm = torch.bincount(t[:, 3], minlength=sms).double()
        sm_end = torch.zeros(sms, dtype=torch.float64).scatter_reduce(0, t[:, 3], ends.double(), reduce="amax")
        print(f"== {preset} {n}x{ctx}: {len(t)} programs, graph replay {ms:.4f} ms (quantiles 0/10/50/90/99/100)")
        print(f"start us    {quantiles((t[:, 0] - t0) / 1e3)}")
        print(f"duration us {quantiles(dur)}")
        print(f"end us      {quantiles(ends)}")
        ghz = (t[:, 2].double() / (dur.double() * 1e3)).median()
        print(f"programs per SM {per_sm.min():.0f}-{per_sm.max():.0f}, SM clock {ghz:.2f} GHz (clock64 / globaltimer)")
        print(f"SMs' last end us {quantiles(sm_end[per_sm > 0])}")
        case.free()
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
