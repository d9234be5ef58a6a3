"""Needle cases: the needle is its own paragraph, the prompt is plain text, the answer is locatable.

Injected: seeded passkey and multi-fact cases over the real essays. Must happen: the asked needle
sits between blank lines at about its depth, the question ends with the answer's lead-in, the
token ids carry no chat-template tokens, the answer's rows are found in the prompt and nowhere in
the question, and the task mix and depths follow the documented cycle.
"""

from __future__ import annotations

import pytest

from semkv.evaluation.needles import TASK_CYCLE, answer_rows, make_case, make_cases, prompt_ids


@pytest.mark.parametrize("task", ["passkey", "multifact"])
def test_needle_is_its_own_paragraph_in_a_plain_text_prompt(tokenizer, task):
    case = make_case(tokenizer, task, 1024, seed=3, depth=0.5)
    assert f"\n\n{case.needle_text}\n\n" in case.prompt
    at = case.prompt.index(case.needle_text) / len(case.prompt)
    assert 0.3 < at < 0.7
    lead = "The pass key is" if task == "passkey" else case.needle_text.rsplit(" ", 1)[0]
    assert case.prompt.endswith(lead)
    ids = prompt_ids(tokenizer, case)
    assert "<|im_start|>" not in tokenizer.decode(ids)
    rows = answer_rows(tokenizer, ids, case.answer)
    assert rows and max(rows) < len(ids) - 20
    assert case.answer in tokenizer.decode([ids[r] for r in rows])


def test_case_mix_and_depths(tokenizer):
    cases = make_cases(tokenizer, 512, 6, seed=1)
    assert [c.task for c in cases] == [TASK_CYCLE[i % len(TASK_CYCLE)] for i in range(6)]
    assert len({round(c.depth, 3) for c in cases}) == 6
    assert all(0.05 < c.depth < 0.95 for c in cases)
    again = make_cases(tokenizer, 512, 6, seed=1)
    assert [c.prompt for c in again] == [c.prompt for c in cases]
