"""Policy options in the bench's run labels ("name:field=value,..."), tuples included.

Injected: run labels whose option values are tuples (commas inside), several options, a dense-layer
suffix, and malformed values (an unclosed tuple, a bad exact_layers, a word that is not a literal).
Must happen: the policy gets exactly the fields written (a tuple's commas do not split the options); a
malformed label is refused with a ValueError naming the field, before any model loads.
"""

from __future__ import annotations

import pytest

from semkv.bench.sparse import policy_from_label, split_dense_layers, validate_labels


@pytest.mark.parametrize(
    "label, fields",
    [
        ("probe:exact_layers=(3,4,5)", {"exact_layers": (3, 4, 5), "exact_keys": False, "groups": 1}),
        (
            "probe:exact_layers=(5, 3),exact_keys=True,groups=2",
            {"exact_layers": (3, 5), "exact_keys": True, "groups": 2},
        ),
        ("probe:groups=2,exact_layers=(3,)", {"exact_layers": (3,), "groups": 2}),
        ("probe:head_agg='mass',exact_layers=[1,2]", {"exact_layers": (1, 2), "head_agg": "mass"}),
    ],
)
def test_tuple_options_reach_the_policy(label, fields):
    policy = policy_from_label(label, {})
    assert {name: getattr(policy, name) for name in fields} == fields


def test_tuple_options_with_dense_layers():
    policy, dense = split_dense_layers("probe:exact_layers=(3,4)+dense0,1")
    assert dense == (0, 1) and policy_from_label(policy, {}).exact_layers == (3, 4)
    validate_labels(["probe:exact_layers=(3,4)+dense0,1"])


@pytest.mark.parametrize(
    "label, message",
    [
        ("probe:exact_layers=(3,4", "exact_layers of run label .* must be a Python literal"),
        ("probe:exact_layers=(3,3)", "exact_layers must be distinct layer indices"),
        ("probe:exact_layers=(-1,)", "exact_layers must be distinct layer indices"),
        ("probe:exact_keys=True", "exact_keys needs exact_layers"),
        ("probe:head_agg=mass", "head_agg of run label .* must be a Python literal"),
        ("probe:exact_layer=(3,)", "unknown option.*exact_layer"),
    ],
)
def test_bad_option_labels_are_refused(label, message):
    with pytest.raises(ValueError, match=message):
        validate_labels([label])
