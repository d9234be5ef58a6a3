"""Greedy answers of requests that decode together over one shared prefix, in bf16.

Injected: a tiny random llama computing in bf16 (default initialisation: flat logits, so near-ties are
common and a rounding difference moves a greedy token), float32 KV, 4-token blocks, no memory tier (a
hit comes from the page pool), serving up to four requests at a time through the scheduler, arriving
at random steps; 120 requests drawn from twelve prompts over three documents behind one chat template,
so most are prefix hits whose caches read a shared prefix — whole, or only its first rows — while they
decode in one batched step or alone beside a prefilling reader.

Must happen: every answer equals the same prompt's answer with no reuse, decoded alone (a prefix
reader's attention output is summed in float32 and rounded once, as the one-piece product is: summing
bf16-rounded pieces instead changed answers here); several running caches did read one prefix.
"""

from __future__ import annotations

import random

from semkv.scheduler import SchedulerConfig
from tests.conftest import tiny_hf_model

QUESTIONS = ["What happened next?", "Who was there?", "Why did it matter?", "Where was it?"]
DOCUMENTS = [
    "The lighthouse keeper on the northern island logs every passing ship in a green ledger. ",
    "Marmalade was first sold in Dundee by a grocer whose ship had brought a cargo of bitter oranges. ",
    "A glacier in the southern range moved eleven metres in one summer, surprising the survey team. ",
]
PROMPTS = [doc * 3 + q for doc in DOCUMENTS for q in QUESTIONS]
REQUESTS = 120
RUNNING = 4
OPTIONS = dict(max_new_tokens=4, stop_at_eos=False)  # the chat template: one system prompt before all


def test_answers_over_a_shared_prefix_equal_no_reuse_in_bf16(make_tiny_engine, tokenizer):
    def engine():
        model = tiny_hf_model("llama", len(tokenizer))
        return make_tiny_engine("llama", hf_model=model, compute_dtype="bfloat16", memory_bytes=0, disk=False)

    reference = engine()
    want = {
        p: reference.generate(prompt=p, reuse="none", store_prompt=False, **OPTIONS).token_ids
        for p in PROMPTS
    }
    served = engine()
    served.scheduler.config = SchedulerConfig(max_running=RUNNING, max_batched_tokens=512)
    rng = random.Random(0)
    prompt_of: dict[str, str] = {}
    answers: dict[str, list[int]] = {}
    most_readers = 0
    while len(answers) < REQUESTS:
        for _ in range(rng.choice([0, 0, 1, 1, 2, 3])):
            if len(prompt_of) < REQUESTS and len(prompt_of) - len(answers) < RUNNING:
                prompt = rng.choice(PROMPTS)
                prompt_of[served.add_request(prompt=prompt, **OPTIONS)] = prompt
        for out in served.step():
            if out.finished:
                answers[out.request_id] = out.generation.token_ids
        prefixes = [entry.seq.cache.prefix for entry in served.scheduler.running]
        most_readers = max([most_readers] + [len(p.holders) for p in prefixes if p is not None])
    assert most_readers >= 2
    wrong = [(prompt_of[rid], got) for rid, got in answers.items() if got != want[prompt_of[rid]]]
    assert not wrong, wrong[:3]
