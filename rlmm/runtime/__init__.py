"""The machine and the processes under every stage: CPU facts, devices, the environment, collectives over ranks, disk writes, errors, timing and number formatting. Imports nothing else of rlmm."""
