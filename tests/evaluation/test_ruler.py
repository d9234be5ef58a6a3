"""RULER workloads: our generators against RULER's task table, lengths, placement and scoring.

Injected: the package's synthetic.yaml, essays, SQuAD and HotpotQA; the SmolLM2 tokenizer. Must
happen: the task table equals synthetic.yaml; a case is a pure function of its seed; every case fits
prompt + generation budget into the target length, within one haystack unit of it, as it is sent;
needles, chains and gold documents occur exactly once at their recorded depth; cwe / fwe answers are
the list's true most frequent words; QA questions differ within a run and come from the split; the
chat rendering opens the assistant turn with the answer prefix; scoring matches hand-computed values.
"""

from __future__ import annotations

import math
import re
from collections import Counter

import pytest

from semkv.evaluation.corpora import hotpot_split, squad_split
from semkv.evaluation.ruler import (
    TASK_NAMES,
    TASKS,
    Rendering,
    clean_prediction,
    largest_fitting,
    make_case,
    make_cases,
    prompt_ids,
    request_options,
    score,
    string_match_all,
    string_match_part,
    summarize,
)
from semkv.evaluation.ruler_tasks import (
    CommonWordsTask,
    FrequentWordsTask,
    NiahTask,
    QaTask,
    VariableTrackingTask,
    draw_unique,
    split_sentences,
    zeta,
)
from semkv.models.loader import package_folder

NIAH = [t for t in TASK_NAMES if t.startswith("niah")]
QA = ("qa_1", "qa_2")


def test_task_table_matches_synthetic_yaml():
    import yaml

    table = yaml.safe_load((package_folder("long_context_eval") / "synthetic.yaml").read_text())
    assert list(table) == list(TASK_NAMES)
    for name, entry in table.items():
        args, spec = entry["args"], TASKS[name]
        assert entry["task"] == spec.family
        if entry["task"] == "niah":
            expected = NiahTask(
                args["type_haystack"],
                args["type_needle_k"],
                args["type_needle_v"],
                args["num_needle_k"],
                args["num_needle_v"],
                args["num_needle_q"],
            )
        elif entry["task"] == "variable_tracking":
            expected = VariableTrackingTask(**args)
        elif entry["task"] == "common_words_extraction":
            expected = CommonWordsTask(**args)
        elif entry["task"] == "freq_words_extraction":
            expected = FrequentWordsTask(**args)
        else:
            expected = QaTask(args["dataset"])
        assert spec == expected, name


@pytest.fixture(scope="module")
def cases_4k(tokenizer):
    """Two 4K cases per task (SmolLM2, chat template, answer prefix)."""
    return {task: make_cases(tokenizer, task, 4096, 2, seed=5) for task in TASK_NAMES}


@pytest.mark.parametrize("task", TASK_NAMES)
def test_cases_fit_the_length_as_they_are_sent(tokenizer, cases_4k, task):
    for case in cases_4k[task]:
        assert case.prompt_tokens == len(prompt_ids(tokenizer, case))
        total = case.prompt_tokens + case.tokens_to_generate
        tolerance = 320 if task in QA else 64  # one haystack unit: a document, or a line of needles/noise
        assert 4096 - tolerance <= total <= 4096, (task, total)


@pytest.mark.parametrize("task", TASK_NAMES)
def test_a_case_is_a_pure_function_of_its_seed(tokenizer, cases_4k, task):
    again = make_case(tokenizer, task, 4096, seed=5, index=1)
    assert again == cases_4k[task][1]
    assert again.prompt != cases_4k[task][0].prompt
    other = make_case(tokenizer, task, 4096, seed=6, index=1)
    dev = make_case(tokenizer, task, 4096, seed=5, index=1, split="dev")
    assert other.outputs != again.outputs and dev.outputs != again.outputs


@pytest.mark.parametrize("task", NIAH)
def test_needles_occur_once_at_their_depth(cases_4k, task):
    for case in cases_4k[task]:
        spec = TASKS[task]
        assert len(case.outputs) == spec.num_values * spec.num_queries
        assert len(case.inserted) == len(case.depths) == len(case.outputs)
        for value, needle, depth in zip(case.outputs, case.inserted, case.depths, strict=True):
            assert value in needle
            assert case.context.count(value) == 1
            assert case.context.count(needle) == 1
            assert case.context.index(needle) / len(case.context) == pytest.approx(depth, abs=0.05)
        keys = re.split(r", (?:and )?", case.query)
        assert len(keys) == spec.num_queries
        for key in keys:
            assert case.context.count(f" for {key} is: ") == spec.num_values
        needles = case.context.count("One of the special magic")
        if spec.haystack == "needle":  # every line is a needle; only the asked one has the asked key
            assert needles == len(case.context.split("\n"))
        else:
            assert needles == max(spec.num_keys, spec.num_queries) * spec.num_values


def test_variable_chain_occurs_once_in_order(cases_4k):
    for case in cases_4k["vt"]:
        value = case.query
        assert case.context.count(value) == 1
        assert [case.context.count(s) for s in case.inserted] == [1] * 5
        positions = [case.context.index(s) for s in case.inserted]
        assert positions == sorted(positions)
        assert [p / len(case.context) for p in positions] == pytest.approx(list(case.depths), abs=1e-9)
        assert case.inserted[0] == f"VAR {case.outputs[0]} = {value}"
        assert case.answer_prefix.startswith(" Answer:") and value in case.answer_prefix
        example_user, example_reply = case.example
        assert example_reply.startswith("Answer:") and len(example_reply.split(":")[-1].split()) == 5


def test_common_words_are_the_most_frequent_in_the_list(cases_4k, tokenizer):
    for case in cases_4k["cwe"]:
        counts = Counter(re.findall(r"\d+\. (\w+)", case.context))
        assert {w for w, c in counts.items() if c == 30} == set(case.outputs)
        assert max(c for w, c in counts.items() if w not in case.outputs) == 3
    short = make_case(tokenizer, "cwe", 2048, seed=1)  # below 4K RULER repeats 6 and 1 times
    counts = Counter(re.findall(r"\d+\. (\w+)", short.context))
    assert {w for w, c in counts.items() if c == 6} == set(short.outputs)


def test_frequent_words_are_ranks_two_to_four(cases_4k):
    for case in cases_4k["fwe"]:
        ranked = [w for w, _ in Counter(case.context.split()).most_common()]
        assert ranked[0] == "..."
        assert tuple(ranked[1:4]) == case.outputs


@pytest.mark.parametrize(("task", "split_fn"), [("qa_1", squad_split), ("qa_2", hotpot_split)])
def test_qa_gold_documents_and_questions(tokenizer, cases_4k, task, split_fn):
    cases = cases_4k[task]
    test_questions = {item.question for item in split_fn("test")}
    assert len({c.query for c in cases}) == len(cases)
    for case in cases:
        assert case.query in test_questions
        assert case.prompt.endswith(f"Question: {case.query}")
        for doc, depth in zip(case.inserted, case.depths, strict=True):
            assert case.context.count(doc + "\n\n") + case.context.endswith(doc) == 1
            assert case.context.index(doc) / len(case.context) == pytest.approx(depth, abs=0.02)
        if task == "qa_1":
            assert any(answer in case.context for answer in case.outputs)
    dev = make_case(tokenizer, task, 4096, seed=5, index=0, split="dev")
    assert dev.query not in test_questions


def test_renderings(tokenizer, cases_4k):
    case = cases_4k["niah_single_2"][0]
    text = tokenizer.decode(prompt_ids(tokenizer, case))
    assert text.endswith("<|im_start|>assistant\n" + case.answer_prefix.strip())
    assert (
        case.assistant_start()
        == "The special magic number for " + case.query + " mentioned in the provided text is"
    )
    plain = make_case(tokenizer, "niah_single_2", 4096, seed=5, rendering=Rendering(chat=False))
    plain_text = tokenizer.decode(prompt_ids(tokenizer, plain))
    assert "<|im_start|>" not in plain_text and plain_text.endswith(plain.answer_prefix)
    assert plain.plain_text() == plain.prompt + plain.answer_prefix
    bare = make_case(tokenizer, "niah_single_2", 4096, seed=5, rendering=Rendering(answer_prefix=False))
    assert tokenizer.decode(prompt_ids(tokenizer, bare)).endswith("<|im_start|>assistant\n")
    assert bare.assistant_start() == ""
    # the bare prompt leaves more room for the haystack than the one that carries the prefix
    assert len(bare.context) >= len(case.context)
    cwe = cases_4k["cwe"][0]
    roles = [m["role"] for m in cwe.messages()]
    assert roles == ["user", "assistant", "user"]
    assert cwe.messages()[-1]["content"] == cwe.prompt


@pytest.mark.parametrize(
    ("prediction", "outputs", "all_score", "part_score"),
    [
        ("The numbers are 123 and 456.", ["123", "456", "789"], 100 * 2 / 3, 100),
        ("ABC-def", ["abc-DEF"], 100, 100),
        ("nothing", ["x1", "y2"], 0, 0),
        ("", ["a"], 0, 0),
        ("\x00 Paris\x01France ", ["paris\nfrance"], 100, 100),  # control characters become newlines
    ],
)
def test_string_match_scores(prediction, outputs, all_score, part_score):
    assert string_match_all(prediction, outputs) == pytest.approx(all_score)
    assert string_match_part(prediction, outputs) == pytest.approx(part_score)


def test_score_uses_the_case_metric_and_summary_averages_tasks(cases_4k):
    niah, qa = cases_4k["niah_multivalue"][0], cases_4k["qa_1"][0]
    assert score(niah, " ".join(niah.outputs[:3])) == pytest.approx(75)
    assert score(qa, f"It is {qa.outputs[0]}.") == 100
    summary = summarize([("a", 100), ("a", 0), ("a", 100), ("b", 0)])
    assert summary.per_task == pytest.approx({"a": 200 / 3, "b": 0})
    assert summary.counts == {"a": 3, "b": 1}
    assert summary.average == pytest.approx(100 / 3)  # mean of task means, not of cases (25)
    assert clean_prediction(None) == ""


def test_sentence_splitter():
    text = 'Mr. Smith went home. He slept! Then 3 dogs came? "Yes." J. R. Tolkien wrote e.g. this. End'
    assert split_sentences(text) == [
        "Mr. Smith went home.",
        "He slept!",
        "Then 3 dogs came?",
        '"Yes."',
        "J. R. Tolkien wrote e.g. this.",
        "End",
    ]


def test_largest_fitting_and_zeta():
    assert largest_fitting(lambda n: 3 * n + 10, 100, 1, 1000) == (30, 100)
    assert largest_fitting(lambda n: 3 * n + 10, 100, 1, 1000, hint=900) == (30, 100)
    assert largest_fitting(lambda n: n * n, 1000, 1, 10**6) == (31, 961)
    assert largest_fitting(lambda n: n, 50, 1, 20) == (20, 20)
    with pytest.raises(ValueError, match="smallest"):
        largest_fitting(lambda n: 100 + n, 50, 1, 20)
    assert zeta(2.0) == pytest.approx(math.pi**2 / 6, rel=1e-9)


def test_bad_input_names_the_field(tokenizer):
    with pytest.raises(ValueError, match="unknown RULER task"):
        make_case(tokenizer, "niah_single_9", 4096)
    with pytest.raises(ValueError, match="length"):
        make_case(tokenizer, "vt", 100)
    with pytest.raises(ValueError, match="split"):
        make_case(tokenizer, "vt", 4096, split="train")
    with pytest.raises(ValueError, match="num_values"):
        NiahTask("essay", "words", "numbers", num_values=0)


def test_drawn_values_skip_taken_ones_and_those_in_the_haystack():
    import random

    first_two = draw_unique("numbers", 2, random.Random(0), set())
    again = draw_unique("numbers", 2, random.Random(0), {first_two[0]}, haystack=f"... {first_two[1]} ...")
    assert first_two[0] not in again and first_two[1] not in again
    taken: set[str] = set()
    keys = draw_unique("words", 300, random.Random(1), taken)
    assert len(set(keys)) == 300 and taken == set(keys)
    assert all(re.fullmatch(r"[a-z]+-[a-z]+", k) for k in keys)
    assert all(
        re.fullmatch(r"[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}", u)
        for u in draw_unique("uuids", 20, random.Random(2), set())
    )


@pytest.mark.parametrize("chat", [None, False])
def test_request_options_lay_out_the_cases_ids(tokenizer, chat):
    """A case sent through semkv's request layout (GenerateRequest fields) is token for token the ids its
    length was fitted on: chat messages + answer prefix, or RULER's plain text."""
    from semkv.prompt import build_layout
    from semkv.request import GenerateRequest

    for task in ("niah_single_2", "vt", "qa_1"):
        case = make_case(tokenizer, task, 1024, seed=5, rendering=Rendering(chat=chat))
        request = GenerateRequest(**request_options(tokenizer, case))
        layout = build_layout(
            tokenizer,
            request.prompt,
            request.messages,
            (),
            request.use_chat_template,
            request.assistant_prefix,
        )
        assert layout.token_ids == prompt_ids(tokenizer, case), task
