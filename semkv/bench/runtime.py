"""Runtime speed and precision: our prefill and decode in fp32 and bf16 against HF's forward in both.

At each context length (default 512 / 2K / 8K tokens of essay text, no chat template), side by side
in one run, warm-up excluded, repeats interleaved so that machine noise hits every system alike:

* prefill: our engine's full prefill (``Engine.prefill``: TTFT, first token sampled) in each compute
  dtype vs HF's ``model(ids, logits_to_keep=1)`` (the last token's logits only, as ``generate``
  computes them) in fp32 and bf16 (the model cast with ``.to(torch.bfloat16)``);
* decode: ms/token of our engine's decode steps vs HF's forward with its own cache (one token per
  call, greedy): as the user sees it (from the first generated token to the last) and the steady-state
  step (the median time between two consecutive tokens);
* precision: first-token KL(fp32 || bf16) over several texts per length (ours and HF's), and greedy
  agreement: the decoded tokens of bf16 equal to fp32's before the first difference.

``--bandwidth`` also measures the machine's memory read bandwidth, and prints the time a decode step
needs at that bandwidth to read the bf16 weights and the KV once (the floor of a batch-1 step).
"""

from __future__ import annotations

import argparse
import copy
import time
from typing import Any

import torch
from tqdm import tqdm

from semkv.bench.prefix import plain_request
from semkv.bench.report import median, write_results
from semkv.evaluation.essays import haystack
from semkv.evaluation.metrics import logit_kl
from semkv.models.linear import Projection

SYSTEMS = ("ours_fp32", "ours_bf16", "hf_fp32", "hf_bf16")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--contexts", default="512,2048,8192", help="prompt lengths in tokens, comma-separated")
    p.add_argument("--repeats", type=int, default=3, help="timed prefills per system and length (median)")
    p.add_argument("--decode-tokens", type=int, default=32, help="greedy tokens decoded per measurement")
    p.add_argument("--kl-texts", type=int, default=4, help="texts per length for the first-token KL")
    p.add_argument("--bandwidth", action="store_true", help="also measure memory read bandwidth")


def agreement(reference: list[int], other: list[int]) -> int:
    """Tokens of ``other`` equal to ``reference`` before the first difference."""
    for i, (a, b) in enumerate(zip(reference, other, strict=False)):
        if a != b:
            return i
    return min(len(reference), len(other))


class HFSystem:
    """HF's own forward: prefill (last token's logits only) and one-token decode steps with its cache."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model

    @torch.inference_mode()
    def prefill(self, ids: list[int]) -> tuple[float, torch.Tensor, Any]:
        """(seconds, last logits [V] float32, HF cache)."""
        start = time.perf_counter()
        out = self.model(torch.tensor([ids]), use_cache=True, logits_to_keep=1)
        return time.perf_counter() - start, out.logits[0, -1].float(), out.past_key_values

    @torch.inference_mode()
    def decode(self, ids: list[int], tokens: int) -> tuple[float, float, list[int]]:
        """(seconds per token from the first generated token to the last, median seconds of one step,
        greedy tokens)."""
        _, logits, cache = self.prefill(ids)
        out_tokens = [int(logits.argmax())]
        stamps = [time.perf_counter()]
        for _ in range(tokens - 1):
            out = self.model(torch.tensor([[out_tokens[-1]]]), past_key_values=cache, use_cache=True)
            cache = out.past_key_values
            out_tokens.append(int(out.logits[0, -1].argmax()))
            stamps.append(time.perf_counter())
        return per_token_seconds(stamps), median_step_seconds(stamps), out_tokens


class EngineSystem:
    """Our engine's public steps: ``prefill`` (TTFT) and ``decode``."""

    def __init__(self, engine) -> None:
        self.engine = engine

    def prefill(self, text: str) -> tuple[float, torch.Tensor]:
        seq = self.engine.prefill(plain_request(text, 1))
        return seq.ttft_s, seq.first_logits

    def decode(self, text: str, tokens: int) -> tuple[float, float, list[int]]:
        """(seconds per token from the first generated token to the last, median seconds between two
        streamed tokens, greedy tokens)."""
        seq = self.engine.prefill(plain_request(text, tokens))
        stamps: list[float] = []
        self.engine.decode(seq, on_token=lambda _token: stamps.append(time.perf_counter()))
        return seq.decode_s / max(1, tokens - 1), median_step_seconds(stamps), list(seq.tokens)


def per_token_seconds(stamps: list[float]) -> float:
    """Seconds per token from the first of ``stamps`` (one per token) to the last."""
    return (stamps[-1] - stamps[0]) / max(1, len(stamps) - 1)


def median_step_seconds(stamps: list[float]) -> float:
    """Median seconds between consecutive ``stamps``: the steady-state step."""
    return median([b - a for a, b in zip(stamps, stamps[1:], strict=False)]) if len(stamps) > 1 else 0.0


def memory_bandwidth(megabytes: int = 512, repeats: int = 5) -> float:
    """Weight-read bandwidth in GB/s as a decode step's matmuls see it: the median time of one bf16
    matrix-vector product over a matrix far larger than the caches, its weight packed as the runtime
    packs its own (:class:`~semkv.models.linear.Projection`; plain ``F.linear`` reorders the weight on
    every call and reads far slower)."""
    width = 1024
    weight = torch.ones(megabytes * 2**20 // (2 * width), width, dtype=torch.bfloat16)
    product = Projection.make(weight)
    x = torch.ones(1, width, dtype=torch.bfloat16)
    product(x)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        product(x)
        times.append(time.perf_counter() - start)
    return weight.numel() * 2 / median(times) / 1e9


def _prefill(system: Any, text: str, ids: list[int]) -> tuple[float, torch.Tensor]:
    """(seconds, first logits) of one prefill: our engines take the text, HF the same token ids."""
    if isinstance(system, EngineSystem):
        return system.prefill(text)
    seconds, logits, _ = system.prefill(ids)
    return seconds, logits


def measure_length(
    systems: dict[str, Any], tokenizer, length: int, args: argparse.Namespace, tick
) -> dict[str, Any]:
    """One row: prefill seconds, decode ms/token, KL and agreement of every system at ``length`` tokens."""
    texts = [haystack(tokenizer, length, start_essay=i) for i in range(max(1, args.kl_texts))]
    ids = [systems["ours_fp32"].engine.layout(plain_request(t, 1)).token_ids for t in texts]
    first = {name: [] for name in systems}  # first logits per text
    prefill = {name: [] for name in systems}
    for s in systems.values():  # warm-up
        _prefill(s, texts[0][:400], ids[0][:64])
    for r in range(max(1, args.repeats)):  # timed, on the first text
        for name, s in systems.items():
            seconds, logits = _prefill(s, texts[0], ids[0])
            prefill[name].append(seconds)
            if r == 0:
                first[name].append(logits)
        tick()
    for text, text_ids in zip(texts[1:], ids[1:], strict=True):  # more texts for the KL
        for name, s in systems.items():
            first[name].append(_prefill(s, text, text_ids)[1])
        tick()
    decode, step, tokens = {}, {}, {}
    for name, s in systems.items():
        arg = texts[0] if name.startswith("ours") else ids[0]
        decode[name], step[name], tokens[name] = s.decode(arg, args.decode_tokens)
        tick()
    row: dict[str, Any] = {"context_tokens": len(ids[0])}
    for name in systems:
        row[f"prefill_s_{name}"] = median(prefill[name])
    for name in systems:
        row[f"decode_ms_{name}"] = 1000 * decode[name]
    for name in systems:
        row[f"step_ms_{name}"] = 1000 * step[name]
    best_hf_decode = min(row["decode_ms_hf_fp32"], row["decode_ms_hf_bf16"])
    row["prefill_bf16_over_hf_fp32"] = row["prefill_s_ours_bf16"] / row["prefill_s_hf_fp32"]
    row["prefill_bf16_over_hf_bf16"] = row["prefill_s_ours_bf16"] / row["prefill_s_hf_bf16"]
    row["decode_bf16_over_hf_best"] = row["decode_ms_ours_bf16"] / best_hf_decode
    row["decode_fp32_over_hf_best"] = row["decode_ms_ours_fp32"] / best_hf_decode
    row["kl_ours_bf16"] = median(
        [logit_kl(a, b) for a, b in zip(first["ours_fp32"], first["ours_bf16"], strict=True)]
    )
    row["kl_hf_bf16"] = median(
        [logit_kl(a, b) for a, b in zip(first["hf_fp32"], first["hf_bf16"], strict=True)]
    )
    row["kl_texts"] = len(texts)
    row["greedy_agree_ours"] = agreement(tokens["ours_fp32"], tokens["ours_bf16"])
    row["greedy_agree_hf"] = agreement(tokens["hf_fp32"], tokens["hf_bf16"])
    row["greedy_of"] = args.decode_tokens
    return row


def run(args: argparse.Namespace) -> int:
    from semkv.config import StoreConfig
    from semkv.engine import Engine

    fp32 = Engine.from_args(args, store=StoreConfig(disk=False), compute_dtype="float32")
    bf16 = fp32.twin(compute_dtype="bfloat16")
    systems: dict[str, Any] = {
        "ours_fp32": EngineSystem(fp32),
        "ours_bf16": EngineSystem(bf16),
        "hf_fp32": HFSystem(fp32.hf_model),
        "hf_bf16": HFSystem(copy.deepcopy(fp32.hf_model).to(torch.bfloat16)),
    }
    lengths = [min(int(n), fp32.max_context - args.decode_tokens - 8) for n in args.contexts.split(",")]
    steps = len(lengths) * (max(1, args.repeats) + max(1, args.kl_texts) - 1 + len(systems))
    bar = tqdm(total=steps, desc="bench runtime")
    rows = [measure_length(systems, fp32.tokenizer, n, args, bar.update) for n in lengths]
    bar.close()
    extra: dict[str, Any] = {"threads": torch.get_num_threads()}
    if args.bandwidth:
        extra["bandwidth_GBps"] = memory_bandwidth()
        weights = sum(p.numel() * p.element_size() for p in bf16.adapter.hf_model.parameters())
        extra["bf16_weight_bytes"] = weights
        for row in rows:
            kv = 2 * bf16.adapter.num_layers * bf16.adapter.num_kv_heads * bf16.adapter.head_dim * 2
            floor = (weights + kv * row["context_tokens"]) / (extra["bandwidth_GBps"] * 1e9)
            row["decode_floor_ms_bf16"] = 1000 * floor
    config = {k: v for k, v in vars(args).items() if k not in ("func", "bench_run")}
    notes = (
        "Ratios: ours in bf16 over HF fp32 / HF bf16 (prefill), over HF's faster dtype (decode). "
        "KL: first-token KL(fp32 || bf16), median over texts. Greedy agreement: bf16 tokens equal to "
        "fp32's before the first difference, of greedy_of.\n"
    )
    write_results(args.out, "runtime", rows, config, extra=extra, notes=notes)
    for row in rows:
        print(
            f"{row['context_tokens']:>5} tokens | prefill s: ours fp32 {row['prefill_s_ours_fp32']:.3f} "
            f"bf16 {row['prefill_s_ours_bf16']:.3f} | HF fp32 {row['prefill_s_hf_fp32']:.3f} "
            f"bf16 {row['prefill_s_hf_bf16']:.3f} | ours bf16 / HF fp32 {row['prefill_bf16_over_hf_fp32']:.2f}, "
            f"/ HF bf16 {row['prefill_bf16_over_hf_bf16']:.2f}"
        )
        print(
            f"      decode ms/token: ours fp32 {row['decode_ms_ours_fp32']:.1f} bf16 {row['decode_ms_ours_bf16']:.1f}"
            f" | HF fp32 {row['decode_ms_hf_fp32']:.1f} bf16 {row['decode_ms_hf_bf16']:.1f} | ours bf16 / HF best "
            f"{row['decode_bf16_over_hf_best']:.2f}"
            + (f" | floor {row['decode_floor_ms_bf16']:.1f}" if "decode_floor_ms_bf16" in row else "")
        )
        print(
            f"      steady step ms: ours fp32 {row['step_ms_ours_fp32']:.1f} bf16 {row['step_ms_ours_bf16']:.1f}"
            f" | HF fp32 {row['step_ms_hf_fp32']:.1f} bf16 {row['step_ms_hf_bf16']:.1f}"
        )
        print(
            f"      first-token KL bf16 vs fp32: ours {row['kl_ours_bf16']:.2e}, HF {row['kl_hf_bf16']:.2e} "
            f"(median of {row['kl_texts']}); greedy agreement ours {row['greedy_agree_ours']}/{row['greedy_of']},"
            f" HF {row['greedy_agree_hf']}/{row['greedy_of']}"
        )
    if "bandwidth_GBps" in extra:
        print(
            f"memory read bandwidth {extra['bandwidth_GBps']:.1f} GB/s; bf16 weights {weights / 1e6:.0f} MB"
        )
    print(f"results in {args.out}/runtime.json and runtime.md")
    return 0
