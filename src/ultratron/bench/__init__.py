"""`ultratron bench sweep`: a grid of parallel layouts × models, each trained for a few steps in its
own `ultratron train` process (torchrun locally, or one task of a Slurm job array), measured from
its metrics.jsonl and memory files, set beside the planner's prediction, and reported as one CSV,
a markdown table and a heatmap. Finished cells are never rerun.

  cells.py   the grid: layouts from explicit lists, a cartesian grid or the planner's top-K
  run.py     one cell: its config, its process, its outcome (ok, or why not), resumable
  report.py  predictions, errors, CSV, markdown and the heatmap PNG
"""
