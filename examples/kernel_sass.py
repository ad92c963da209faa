"""The attention kernel's machine code for sm_90a, on a machine without a GPU: the Hopper (Gluon) kernel compiled
through ptxas for a stand-in sm_90 driver, bf16 and FP8, head_dim 128, 128-key tiles, a plain store; per variant,
the instructions of a consumer's steady-state key loop (the innermost loop holding the wgmmas) by opcode, and the
kernel's local-memory spill stores.

    python examples/kernel_sass.py --out docs/benchmarks/attention-sass-sm90

Static counts, not timings: what each key tile costs in issue slots, which a GPU run then prices."""
from __future__ import annotations

import argparse
import collections
import json
import os
import re
import subprocess
import tempfile
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)  # compile, not interpret (read when the kernels are defined)

import torch  # noqa: E402
import triton  # noqa: E402

from provenance import provenance, write_records  # noqa: E402
from xstage_dit.testing.sm90_target import target_sm90  # noqa: E402

# a SASS line: /*address*/ [predicate] OPCODE.modifiers operands ;
_LINE = re.compile(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")


def _sass(cubin: Path) -> list[tuple[int, str]]:
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    listing = subprocess.run([str(tool), "-sass", str(cubin)], capture_output=True, text=True, check=True).stdout
    return [(int(match.group(1), 16), match.group(2)) for match in map(_LINE.match, listing.splitlines()) if match]


def _opcode(instruction: str) -> str:
    return re.sub(r"^@!?U?P\w+\s+", "", instruction).split()[0].split(".")[0]


def key_loop(sass: list[tuple[int, str]]) -> list[str]:
    """The smallest loop (a backward branch's body) with two or more wgmmas: a consumer's key loop."""
    index = {address: i for i, (address, _) in enumerate(sass)}
    loops = []
    for i, (address, instruction) in enumerate(sass):
        target = re.search(r"0x([0-9a-f]+)", instruction.split("BRA", 1)[1]) if "BRA" in instruction else None
        start = int(target.group(1), 16) if target else address
        if start < address and start in index:
            body = [text for _, text in sass[index[start]:i + 1]]
            if sum("GMMA" in text for text in body) >= 2:
                loops.append(body)
    return min(loops, key=len)


def compile_variant(fp8: bool) -> Path:
    """Compile the Hopper kernel (bf16 or FP8) into a fresh cache; the folder holding its cubin."""
    from xstage_dit.kernels import attention_hopper as hopper
    from xstage_dit.kernels.attention_args import AttentionCall, Store
    from xstage_dit.kernels.attention_fp8 import quantize

    os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp()
    batch, seq, heads, head_dim = 2, 1000, 3, 128
    q = torch.empty(batch, seq, heads, head_dim, dtype=torch.bfloat16)
    config = hopper.HopperConfig()
    operands = (quantize(q, q, q, seq, config.block_m, config.block_n, operand_order=True, warmup=True) if fp8
                else None)
    epilogue = Store(q)
    call = AttentionCall(q, q, q, head_dim**-0.5, seq, None, epilogue, epilogue.result_for(q), None)
    hopper.launch(call, config, hopper.TmaRows.TOKENS, warmup=True, fp8=operands)
    return next(Path(os.environ["TRITON_CACHE_DIR"]).glob("*/_attention_kernel.cubin"))


def record(variant: str, cubin: Path) -> dict:
    sass = _sass(cubin)
    loop = key_loop(sass)
    return {"kernel": "xstage_attention_hopper", "variant": variant, "shape": "head_dim 128, 128-key tiles",
            "key_loop_instructions": len(loop), "key_loop_wgmmas": sum("GMMA" in text for text in loop),
            "key_loop_by_opcode": dict(collections.Counter(map(_opcode, loop)).most_common()),
            "spill_stores": sum(_opcode(text) == "STL" for _, text in sass)}


OPCODES = ("FADD", "FFMA", "FMUL", "FMNMX", "MUFU", "F2FP", "PRMT", "SHFL", "LOP3", "IADD3", "VIADD", "STL", "LDL")


def table(records: list[dict]) -> list[str]:
    lines = ["| variant | loop instructions | wgmmas | " + " | ".join(OPCODES) + " | spill stores |",
             "|---|---|---|" + "---|" * len(OPCODES) + "---|"]
    for r in records:
        counts = " | ".join(str(r["key_loop_by_opcode"].get(op, 0)) for op in OPCODES)
        lines.append(f"| {r['variant']} | {r['key_loop_instructions']} | {r['key_loop_wgmmas']} | {counts} | "
                     f"{r['spill_stores']} |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("out/attention-sass-sm90"),
                        help="prefix of the .json and .md records")
    args = parser.parse_args()
    target_sm90()
    env = provenance() | {"card": "no GPU (compiled for sm_90a)", "ranks": 1}
    records = [env | record(variant, compile_variant(variant == "fp8")) for variant in ("bf16", "fp8")]
    write_records(records, args.out, "The attention kernel's key loop", "Static counts: the instructions of one "
                  "consumer's steady-state key loop (a 64 x 128 score tile and its p·v an iteration; the masked "
                  "last tile's branch included) by opcode, and the kernel's spill stores.", table(records))


if __name__ == "__main__":
    main()
