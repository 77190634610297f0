"""Options and schemas: every group option is one YAML whose `_target_` names a class (options.py); the apps' own nodes (schema.py). Checked before any work starts."""
