"""Compute kernels that stand in for torch's own where a measurement says they are faster; each is
opt-in (a config field), so the general path runs torch's kernels. Below `parallel` (which applies
them) and `models` (which could call them); they import only torch and `errors`."""
