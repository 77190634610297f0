"""rlmm's Hydra launcher (`hydra/launcher=process`, process_launcher.py) and sweeper (`hydra/sweeper=rlmm`, every
app's: sweeper.py, the basic sweeper counting the jobs that had finished already).

They live here, not in `rlmm/`, because Hydra instantiates a launcher or a sweeper only from a class it found by
scanning the `hydra_plugins` namespace package (hydra/core/plugins.py, `is_in_toplevel_plugins_module`).
"""
