"""From the command line to a job: the apps behind `rlmm` subcommands, overrides checked before any job, the launcher and the prefetch of models and datasets."""
