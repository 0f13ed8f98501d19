"""What runs on the controller: inventory, plan, launch, preflight and the ansible-runner wrapper.

Importable without torch (the controller install has none). The node side is only reached for
`trainer.node.config`, which validates a training config with the standard library and PyYAML.
"""
