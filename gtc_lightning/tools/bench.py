"""Throughput of ``compress`` / ``decompress``: Triton kernels vs the torch reference, one run.

    python -m gtc_lightning.tools.bench                       # sizes 1M,14.6M,100M at 0.5 % density
    python -m gtc_lightning.tools.bench --device cpu --sizes 1M --repeats 3 --fold
    python -m gtc_lightning.tools.bench --compile-only        # compile every kernel for sm_90, no GPU needed

Bytes counted (n elements, m words): compress 12n + 4m (read grad, read and write the
residual, write the words); decompress 4n + 4m (write the output, read the words); the
device-to-device copy 8n (read and write n float32), the memory-bandwidth roofline. These are
effective rates: both backends' compress times include the non-finite check of grad, and the
Triton passes move 16n + 12m bytes in all (see ``ops/triton_kernels.py``), so 75 % of the copy
is their ceiling. Each timed call starts from the same residual; decompress decodes one
message. On CPU only the reference runs: the Triton
interpreter is a correctness tool, not a benchmark.

The update mode's ``fold_emit_`` (on CUDA by default, ``--fold`` on CPU): fold the optimizer's step
into the residual, put the parameter back and emit the words, 20n + 4m bytes (read param, kept and
residual, write param and residual, the words), against a device copy that moves the same 20n bytes;
the reference's two passes (``fold_`` then ``emit_``) beside it, and on CUDA the Triton kernel (on CPU
the NumPy one pass), each checked bit for bit against the reference.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch

from gtc_lightning.ops import compress_torch, torch_ops, update_ops
from gtc_lightning.ops.reference import decompress_reference

SUFFIXES = {"K": 1e3, "M": 1e6, "G": 1e9}


def parse_size(text: str) -> int:
    """``"14.6M"`` -> 14600000."""
    match = re.fullmatch(r"([0-9.]+)([KMG]?)", text.strip().upper())
    if not match:
        raise ValueError(f"size {text!r} is not a number with an optional K/M/G suffix, e.g. 14.6M")
    return int(float(match.group(1)) * SUFFIXES.get(match.group(2), 1))


def parse_density(text: str) -> float:
    """``"0.5%"`` or ``"0.005"`` -> 0.005 words per element."""
    value = float(text.rstrip("%")) / (100 if text.endswith("%") else 1)
    if not 0 < value < 1:
        raise ValueError(f"density must be in (0, 1) words per element, got {text!r}")
    return value


def make_problem(n: int, density: float, device: torch.device, seed: int = 0):
    """Gradient, residual and a float32 tau giving about ``density`` words per element.

    Returns:
        ``(grad [n], residual [n], tau32)``; tau is the ``1 - density`` quantile of
        ``|residual + grad|`` on a random sample of up to 2**20 elements.
    """
    gen = torch.Generator(device=device).manual_seed(seed)
    grad = torch.randn(n, generator=gen, device=device)
    residual = torch.randn(n, generator=gen, device=device)
    sample = torch.randint(n, (min(n, 1 << 20),), generator=gen, device=device)
    tau = torch.quantile((residual[sample] + grad[sample]).abs(), 1 - density).item()
    return grad, residual, float(torch.tensor(tau, dtype=torch.float32))


def median_seconds(run: Callable[[], object], reset: Callable[[], object], repeats: int, device) -> float:
    """Median wall time of ``run()`` over ``repeats`` calls, each after an untimed ``reset()``."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    reset()
    run()  # warm-up: compilation, allocator
    times = []
    for _ in range(repeats):
        reset()
        sync()
        start = time.perf_counter()
        run()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def backends_for(
    device: torch.device, blocks: list[int] | None = None
) -> dict[str, tuple[Callable, Callable]]:
    """The torch reference everywhere, the Triton kernels on CUDA: name -> (compress, decompress).

    Args:
        device: where the benchmark runs.
        blocks: extra compress block sizes to time on CUDA (rows ``triton B=<block>``).
    """
    backends = {"torch reference": (compress_torch, decompress_reference)}
    if device.type == "cuda":
        from gtc_lightning.ops.triton_kernels import COMPRESS_BLOCK, compress_triton, decompress_triton

        backends["triton"] = (compress_triton, decompress_triton)
        for block in blocks or []:
            if block != COMPRESS_BLOCK:
                backends[f"triton B={block}"] = (partial(compress_triton, block=block), decompress_triton)
    return backends


def bench_size(n: int, density: float, device: torch.device, repeats: int, backends: dict) -> list[dict]:
    """Rows for one size: the copy roofline, then each backend (the reference first).

    Rows of backends named ``triton...`` also say whether their words and residual are
    bit-identical to the reference's from the same start.
    """
    grad, residual0, tau32 = make_problem(n, density, device)
    residual = residual0.clone()
    dst = torch.empty_like(grad)
    copy_s = median_seconds(lambda: dst.copy_(grad), lambda: None, repeats, device)
    rows = [
        {"n": n, "backend": "copy (roofline)", "compress_s": copy_s, "compress_gbs": 8 * n / copy_s / 1e9}
    ]
    words_seen = {}
    for name, (compress_fn, decompress_fn) in backends.items():
        row, words = _bench_backend(compress_fn, decompress_fn, grad, residual0, residual, tau32, repeats)
        words_seen[name] = (words.cpu(), residual.cpu())
        rows.append({"n": n, "backend": name, **row})
    w_ref, r_ref = words_seen["torch reference"]
    for row in rows:
        if row["backend"].startswith("triton"):
            w_tri, r_tri = words_seen[row["backend"]]
            row["identical"] = torch.equal(w_ref, w_tri) and torch.equal(bits(r_ref), bits(r_tri))
    return rows


def _bench_backend(compress_fn, decompress_fn, grad, residual0, residual, tau32, repeats):
    """Times one backend; returns its row fields and the words of one call from ``residual0``."""
    device, n = grad.device, grad.numel()
    reset = lambda: residual.copy_(residual0)
    c_s = median_seconds(lambda: compress_fn(grad, residual, tau32), reset, repeats, device)
    reset()
    words = compress_fn(grad, residual, tau32)
    m = words.numel()
    d_s = median_seconds(lambda: decompress_fn(words, n, tau32), lambda: None, repeats, device)
    row = {
        "density": m / n,
        "compress_s": c_s,
        "compress_gbs": (12 * n + 4 * m) / c_s / 1e9,
        "decompress_s": d_s,
        "decompress_gbs": (4 * n + 4 * m) / d_s / 1e9,
    }
    return row, words


def bench_rice(n: int, density: float, device: torch.device, repeats: int) -> list[dict]:
    """Golomb-Rice encode and decode of one message of ``n`` elements at ``density``, per backend.

    The torch code everywhere, and the bit packing ``"auto"`` picks there: Triton's on CUDA, NumPy's on
    CPU (``rice_encode(..., backend=...)``); rows say the bits per word and whether its bytes equal the
    torch bytes.
    """
    from gtc_lightning.ops.rice import rice_bits_per_word, rice_decode, rice_encode

    grad, residual, tau32 = make_problem(n, density, device)
    words = compress_torch(grad, residual, tau32)
    rows, coded = [], {}
    backends = ("torch", "triton") if device.type == "cuda" else ("torch", "numpy")
    for backend in backends:
        data = coded[backend] = rice_encode(words, backend=backend)
        rows.append({
            "n": n, "backend": backend, "words": words.numel(), "bits_per_word": rice_bits_per_word(data),
            "encode_s": median_seconds(lambda b=backend: rice_encode(words, backend=b), lambda: None, repeats, device),
            "decode_s": median_seconds(lambda b=backend, d=data: rice_decode(d, backend=b), lambda: None, repeats, device),
            "round_trip": torch.equal(rice_decode(data, backend=backend), words),
        })  # fmt: skip
    rows[-1]["identical"] = torch.equal(coded[backends[-1]], coded["torch"])
    return rows


def format_rice_table(rows: list[dict]) -> str:
    lines = [
        "| n | Rice backend | words | bits/word | encode ms | decode ms | round trip | bytes = torch's |",
        "|" + "---|" * 8,
    ]
    for r in rows:
        same = {True: "yes", False: "NO"}.get(r.get("identical"), "–")
        lines.append(
            f"| {r['n']:,} | {r['backend']} | {r['words']:,} | {r['bits_per_word']:.2f} | {r['encode_s'] * 1e3:.3f} "
            f"| {r['decode_s'] * 1e3:.3f} | {'yes' if r['round_trip'] else 'NO'} | {same} |"
        )
    return "\n".join(lines)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32)


FOLD_LR = 0.01  # the fold's learning rate: the step over it is of the residual's scale


def fold_reference(param, kept, residual, lr, tau32, message, cursor, bad, offset=0) -> None:
    """``update_ops``' two passes on any device: ``fold_`` then ``torch_ops.emit_``."""
    update_ops.fold_(param, kept, residual, lr)
    torch_ops.emit_(residual, tau32, message, cursor, bad, offset)


def fold_backends_for(device: torch.device) -> dict[str, Callable]:
    """The update mode's fold and emission: the two-pass reference, then the one pass of the device
    (NumPy's on CPU, the Triton kernel on CUDA); name -> a function with ``fold_emit_``'s arguments."""
    if device.type == "cuda":
        from gtc_lightning.ops.triton_kernels import fold_emit_

        return {"torch reference": fold_reference, "triton": fold_emit_}
    return {"torch reference": fold_reference, "numpy one pass": update_ops.fold_emit_}


def bench_fold(n: int, density: float, device: torch.device, repeats: int, backends: dict) -> list[dict]:
    """Rows for the update mode's ``fold_emit_`` at ``n`` elements: a copy of the same bytes, then each
    backend (the reference first); every other row says whether its parameter, residual, words and
    non-finite count are the reference's to the bit. Each timed call starts from the same parameter
    and residual; the message is a buffer of its own (the kept copy stays as it was)."""
    gen = torch.Generator(device=device).manual_seed(1)
    kept = torch.randn(n, generator=gen, device=device)
    param0 = kept - FOLD_LR * torch.randn(n, generator=gen, device=device)
    residual0 = torch.randn(n, generator=gen, device=device)
    sample = torch.randint(n, (min(n, 1 << 20),), generator=gen, device=device)
    folded = residual0[sample] + (kept[sample] - param0[sample]) * update_ops.inverse_rate(FOLD_LR)
    tau32 = float(torch.tensor(torch.quantile(folded.abs(), 1 - density).item(), dtype=torch.float32))
    src = torch.empty(n * 5 // 2, device=device)  # 10n bytes read and 10n written: the fold's 20n
    dst = torch.empty_like(src)
    copy_s = median_seconds(lambda: dst.copy_(src), lambda: None, repeats, device)
    rows = [{"n": n, "backend": "copy (roofline)", "fold_s": copy_s, "fold_gbs": 20 * n / copy_s / 1e9}]
    param, residual = torch.empty_like(param0), torch.empty_like(residual0)
    message = torch.empty(n, dtype=torch.int32, device=device)
    cursor = torch.zeros(1, dtype=torch.int64, device=device)
    bad = torch.zeros(1, dtype=torch.int32, device=device)

    def reset() -> None:
        param.copy_(param0)
        residual.copy_(residual0)
        cursor.zero_()
        bad.zero_()

    results = {}
    for name, fold in backends.items():
        run = lambda fold=fold: fold(param, kept, residual, FOLD_LR, tau32, message, cursor, bad, 0)
        seconds = median_seconds(run, reset, repeats, device)
        reset()
        run()
        m = int(cursor)
        results[name] = [bits(param).cpu(), bits(residual).cpu(), message[:m].cpu(), bad.cpu()]
        rows.append({"n": n, "backend": name, "density": m / n, "fold_s": seconds, "fold_gbs": (20 * n + 4 * m) / seconds / 1e9})
    want = results["torch reference"]
    for row in rows[2:]:
        row["identical"] = all(torch.equal(a, b) for a, b in zip(results[row["backend"]], want))
    return rows


def format_fold_table(rows: list[dict]) -> str:
    """Markdown table of ``bench_fold`` rows; ratios against the copy and the reference of one size."""
    lines = ["| n | fold_emit_ | words/elem | ms | GB/s | % of copy | speed-up | bit-identical |", "|" + "---|" * 8]
    by_key = {(r["n"], r["backend"]): r for r in rows}
    for r in rows:
        copy, ref = by_key[(r["n"], "copy (roofline)")], by_key.get((r["n"], "torch reference"))
        cells = [f"{r['n']:,}", r["backend"], f"{r['density']:.4%}" if "density" in r else "–"]
        cells += [f"{r['fold_s'] * 1e3:.3f}", f"{r['fold_gbs']:.1f}", f"{r['fold_gbs'] / copy['fold_gbs']:.0%}"]
        cells.append(f"{ref['fold_s'] / r['fold_s']:.1f}×" if "density" in r and ref not in (None, r) else "–")
        cells.append({True: "yes", False: "NO"}.get(r.get("identical"), "–"))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def format_table(rows: list[dict]) -> str:
    """Markdown table; ratios are against the copy and the reference of the same size."""
    head = (
        "| n | backend | words/elem | compress ms | compress GB/s | % of copy | "
        "decompress ms | decompress GB/s | speed-up c / d | bit-identical |"
    )
    lines = [head, "|" + "---|" * 10]
    by_key = {(r["n"], r["backend"]): r for r in rows}
    for r in rows:
        copy, ref = by_key[(r["n"], "copy (roofline)")], by_key.get((r["n"], "torch reference"))
        cells = [f"{r['n']:,}", r["backend"], f"{r['density']:.4%}" if "density" in r else "–"]
        cells += [f"{r['compress_s'] * 1e3:.3f}", f"{r['compress_gbs']:.1f}"]
        cells.append(f"{r['compress_gbs'] / copy['compress_gbs']:.0%}" if "density" in r else "100%")
        if "decompress_s" in r:
            cells += [f"{r['decompress_s'] * 1e3:.3f}", f"{r['decompress_gbs']:.1f}"]
            speed = (ref["compress_s"] / r["compress_s"], ref["decompress_s"] / r["decompress_s"])
            cells.append("–" if r is ref else f"{speed[0]:.1f}× / {speed[1]:.1f}×")
        else:
            cells += ["–", "–", "–"]
        cells.append({True: "yes", False: "NO"}.get(r.get("identical"), "–"))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def compile_kernels(arch: int = 90) -> list[dict]:
    """Compile every Triton kernel for ``sm_{arch}`` without a GPU (PTX, and cubin via ptxas).

    Needs ``TRITON_INTERPRET`` unset: the interpreter replaces parts of ``triton.language``
    that code generation uses.

    Returns:
        One dict per kernel: name, block, warps, PTX/cubin bytes, registers, spill bytes,
        shared memory, counts of ``.ftz`` (denormal flushing) and ``fma`` in the PTX, which
        must be 0 for results bit-identical to the CPU reference, and of vector loads/stores.
    """
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from gtc_lightning.ops.triton_kernels import CUDA_CONFIG, FP_OPTIONS, INTERPRETED, KERNELS

    if INTERPRETED:
        raise RuntimeError("TRITON_INTERPRET=1 is set; run the compile check with TRITON_INTERPRET=0")
    cuobjdump = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    rows = []
    for name, (kernel, signature, config, flags) in KERNELS.items():
        block, warps = CUDA_CONFIG[config]
        # As a launch specialises them: 16-byte aligned pointers, sizes divisible by 16.
        aligned = {(i,): [["tt.divisibility", 16]] for i, t in enumerate(signature.values()) if t != "fp32"}
        constexprs = {"BLOCK": block, **flags}
        signature = {**signature, **{key: "constexpr" for key in constexprs}}
        source = ASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=aligned)
        options = {"num_warps": warps, **FP_OPTIONS}
        start = time.perf_counter()
        compiled = triton.compile(source, target=GPUTarget("cuda", arch, 32), options=options)
        ptx, cubin = compiled.asm["ptx"], compiled.asm.get("cubin", b"")
        row = {"kernel": name, "block": block, "warps": warps, "seconds": time.perf_counter() - start}
        row.update(ptx_bytes=len(ptx), cubin_bytes=len(cubin), ftz=ptx.count(".ftz"), fma=ptx.count("fma."))
        row["vector_ops"] = len(re.findall(r"\b(?:ld|st)\.global\.v[24]", ptx))
        row.update(_resource_usage(cubin, cuobjdump))
        rows.append(row)
    return rows


def _resource_usage(cubin: bytes, cuobjdump: Path) -> dict:
    """Registers, spills (local memory) and shared memory from ``cuobjdump``; {} without it."""
    if not cubin or not cuobjdump.exists():
        return {}
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run(
            [str(cuobjdump), "--dump-resource-usage", f.name], capture_output=True, text=True, check=True
        ).stdout
    found = dict(re.findall(r"\b(REG|LOCAL|SHARED):(\d+)", out))
    return {
        "registers": int(found["REG"]),
        "spill_bytes": int(found["LOCAL"]),
        "shared": int(found["SHARED"]),
    }


def format_compile_table(rows: list[dict], arch: int) -> str:
    """Markdown table of ``compile_kernels`` rows."""
    import triton

    lines = [
        f"triton {triton.__version__}, target sm_{arch}, compiled without a GPU (compile s ~0: cached)",
        "| kernel | BLOCK | warps | PTX bytes | cubin bytes | registers | spill bytes | shared | .ftz | fma "
        + "| vector ld/st | compile s |",
        "|" + "---|" * 12,
    ]
    keys = ["kernel", "block", "warps", "ptx_bytes", "cubin_bytes", "registers", "spill_bytes", "shared"]
    keys += ["ftz", "fma", "vector_ops"]
    for r in rows:
        cells = [str(r.get(key, "?")) for key in keys] + [f"{r['seconds']:.2f}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sizes", default="1M,14.6M,100M", help="comma-separated element counts (K/M/G)")
    parser.add_argument("--density", default="0.5%", help="target words per element, e.g. 0.5%% or 0.005")
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    parser.add_argument("--repeats", type=int, default=5, help="timed calls per measurement (median)")
    parser.add_argument(
        "--blocks", default="", help="extra Triton compress block sizes to time, e.g. 2048,4096"
    )
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    parser.add_argument("--rice", action="store_true", help="also time Golomb-Rice encode/decode of the message")
    parser.add_argument("--fold", action=argparse.BooleanOptionalAction, default=None,
                        help="also time the update mode's fold_emit_ (default: on CUDA only)")  # fmt: skip
    parser.add_argument("--json", default="", help="also write the rows to this JSON file")
    parser.add_argument("--compile-only", action="store_true", help="compile the kernels for --arch and stop")
    parser.add_argument("--arch", type=int, default=90, help="CUDA compute capability for --compile-only")
    args = parser.parse_args(argv)
    if args.compile_only:
        print(format_compile_table(compile_kernels(args.arch), args.arch))
        return
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.repeats < 1:
        parser.error(f"--repeats must be >= 1, got {args.repeats}")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda but torch.cuda.is_available() is False")
    auto = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(auto if args.device == "auto" else args.device)
    sizes, density = [parse_size(s) for s in args.sizes.split(",")], parse_density(args.density)
    blocks = [int(b) for b in args.blocks.split(",") if b]
    if device.type == "cuda":
        from gtc_lightning.ops.triton_kernels import INTERPRETED

        if INTERPRETED:
            parser.error("TRITON_INTERPRET=1 is set: unset it to benchmark the compiled kernels")
        print(f"device: {torch.cuda.get_device_name(device)}, torch {torch.__version__}")
    else:
        print(
            f"device: cpu ({torch.get_num_threads()} threads), torch {torch.__version__}: torch reference "
            "only (no CUDA; the Triton interpreter is not a benchmark)"
        )
    print(
        f"target density {density:.3%}; bytes counted: compress 12n+4m, decompress 4n+4m, copy 8n "
        f"(n elements, m words); median of {args.repeats} calls; speed-up = reference time / time"
    )
    fold = device.type == "cuda" if args.fold is None else args.fold
    if fold:
        print("update mode's fold_emit_: bytes counted 20n+4m, against a copy of 20n bytes")
    rows, rice_rows, fold_rows = [], [], []
    for n in sizes:
        rows += bench_size(n, density, device, args.repeats, backends_for(device, blocks))
        if args.rice:
            rice_rows += bench_rice(n, density, device, args.repeats)
        if fold:
            fold_rows += bench_fold(n, density, device, args.repeats, fold_backends_for(device))
        print(f"n={n:,}: done", flush=True)
    print(format_table(rows))
    if rice_rows:
        print()
        print(format_rice_table(rice_rows))
    if fold_rows:
        print()
        print(format_fold_table(fold_rows))
    if args.json:
        device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
        Path(args.json).write_text(json.dumps({
            "device": device_name, "torch": torch.__version__, "density": density, "repeats": args.repeats,
            "rows": rows, "rice": rice_rows, "fold": fold_rows,
        }, indent=1))  # fmt: skip


if __name__ == "__main__":
    main()
