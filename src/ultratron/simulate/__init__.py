"""`ultratron simulate`: one rank of an N-rank layout at a time, through the real `parallelize` and
training step, on a fake process group and fake tensors (shapes, no values), in one CPU process
per simulated rank. `rank.py` runs one rank (torch); `roles.py` picks the ranks and
`collectives.py` checks their collectives against each other (both torch-free); `run.py` starts a
child process per rank and puts the results next to the planner's."""
