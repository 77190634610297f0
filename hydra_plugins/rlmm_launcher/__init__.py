"""rlmm's Hydra launcher (`hydra/launcher=process`, process_launcher.py).

It lives here, not in `rlmm/`, because Hydra instantiates a launcher only from a class it found by
scanning the `hydra_plugins` namespace package (hydra/core/plugins.py, `is_in_toplevel_plugins_module`).
"""
