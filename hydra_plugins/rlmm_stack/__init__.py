"""`correction=a+b+c`: a stack of corrections, spelled like any other option of the group (rlmm/corrections/stack.py).

Hydra finds an option of `correction=` by asking each config source on its search path whether it has the config
`correction/<name>`. This package adds one more source (`StackedCorrections`, scheme `rlmm-stack`, put on every
app's search path by `StackSearchPath`) that has `correction/a+b+c` whenever a, b and c are options of
conf/correction/, and composes it as

    _target_: rlmm.corrections.stack.Stack
    stages: {a: <conf/correction/a.yaml>, b: <...b.yaml>, c: <...c.yaml>}

So a stack is one value of the group: `correction=seq_veto+token_rs+tis`, swept with the others
(`-m correction=tis,seq_veto+token_rs+tis`), recorded as that choice in the run's overrides (`rlmm table` names the
arm by it), composed again by a SLURM job from its overrides, and one stage's parameter is
`correction.stages.<stage>.<key>=...`. `+` is a plain character in Hydra's override grammar, so nothing else changes.
An unknown stage, a stage listed twice or an empty one is refused before Hydra starts (rlmm/launch/overrides.py, one line
naming the allowed stages) and here again (a ConfigLoadError) for a config composed some other way.

Hydra scans only the `hydra_plugins` namespace package for plugins (hydra/core/plugins.py), hence this place.
"""
