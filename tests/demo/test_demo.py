"""``semkv demo`` (the README's first command): every scene runs and reports sane figures.

Injected: the demo on a tiny random model (a checkpoint folder with an 8K context, so every scene
runs at its real sizes in seconds): all scenes through ``run_demo``, one scene through the CLI; and,
marked ``slow``, the real ``semkv demo`` on the embedded SmolLM2 in a subprocess.
Must happen: each scene prints its title and returns its figures: prefix reuse answers identically
with the prompt's blocks reused, blend recomputes a fraction of the prompt, share serves the
paraphrase from the earlier prompt, sparse decodes densely and with Key-Key, the hybrid and the probe at 10%, and says what `sparse="auto"` chose.
"""

from __future__ import annotations

import importlib
import os
import subprocess
import sys

import pytest

from semkv.config import default_home
from semkv.demo import SCENES, run_demo
from semkv.engine import Engine
from semkv.models.loader import resolve_checkpoint
from tests.conftest import require_embedded, tiny_hf_model
from tests.reliability.reliability_helpers import run_cli


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, tokenizer):
    folder = tmp_path_factory.mktemp("demo") / "tiny-llama-8k"
    tiny_hf_model("llama", len(tokenizer), max_position_embeddings=8192).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def test_every_scene_on_a_tiny_model(checkpoint, tmp_path, capsys):
    engine = Engine.from_pretrained(str(checkpoint), home=tmp_path / "home")
    results = run_demo(engine)
    out = capsys.readouterr().out
    assert list(results) == SCENES
    for number, name in enumerate(SCENES, 1):
        title = importlib.import_module(f"semkv.demo.{name}").TITLE
        assert f"=== scene {number}/{len(SCENES)}: {title} ===" in out
    rows = results["prefix"]["rows"]
    assert len(rows) == 2 and all(r["identical"] and r["reused_tokens"] > 1000 for r in rows)
    blend = results["blend"]
    recomputed = [n for label, n in blend["recomputed_tokens"].items() if label != "full prefill"]
    assert len(recomputed) == 3 and all(0 < n < blend["prompt_tokens"] / 2 for n in recomputed)
    share = results["share"]
    assert share["path"] == "share" and share["match_rate"] > 0.6 and share["prompt_tokens"] > 500
    assert set(results["sparse"]) == {"dense", "keykey @10%", "hybrid @10%", "probe @10%"}
    assert all(f["ms_per_token"] > 0 for f in results["sparse"].values())


def test_one_scene_through_the_cli(checkpoint, tmp_path, capsys):
    code, out, err = run_cli(
        ["demo", "--model", str(checkpoint), "--home", str(tmp_path), "--scene", "sparse"], capsys
    )
    assert code == 0, err
    assert "=== scene 1/1: sparse decode" in out and "keykey @10%" in out and "probe @10%" in out
    assert 'sparse="auto" (the default) chose:' in out
    code, _, err = run_cli(["demo", "--model", str(checkpoint), "--scene", "magic"], capsys)
    assert code == 2 and "unknown demo scene(s) ['magic']" in err


@pytest.mark.slow
@pytest.mark.real_model
def test_semkv_demo_on_the_embedded_model(tmp_path):
    """The README's ``semkv demo`` as a user runs it, on SmolLM2 (the converted model is linked into a
    fresh home, so nothing is converted again and the user's store is not touched)."""
    require_embedded("smollm2-135m")
    home = tmp_path / "home"
    (home / "models").mkdir(parents=True)
    (home / "models" / "smollm2-135m").symlink_to(resolve_checkpoint("smollm2-135m", default_home()))
    env = {**os.environ, "SEMKV_HOME": str(home), "TOKENIZERS_PARALLELISM": "false"}
    done = subprocess.run(
        [sys.executable, "-m", "semkv", "demo", "--threads", "2"],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    out = done.stdout
    assert out.count("answers identical: yes") == 2
    assert "tokens each selector recomputed" in out and "share (auto)" in out and "keykey @10%" in out
