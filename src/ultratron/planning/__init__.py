"""Formulas shared by the planner and the trainer. Imports no torch, so `ultratron plan` starts instantly."""
