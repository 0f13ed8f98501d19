"""What runs on the training nodes: one training worker (`trainer train`) and its parts.

Importable in the nodes' venv, which has torch and the training stack but no Ansible. Modules that
need torch import it themselves; `config` stays light so the controller can validate a config.
"""
