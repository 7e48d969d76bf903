"""verl's plugin hook for the lockstep rollout: importing this module registers it (``lockstep.rl.verl.register``).

verl resolves a rollout by name in every process that builds one (the trainer's Ray workers, the checkpoint engine's
rollout workers), not only in the driver that calls ``register()``. verl's ``__init__`` imports every
``verl.plugins`` entry point, and lockstep's package metadata names this module there, so wherever lockstep and
verl are installed together, ``rollout.name=lockstep`` resolves in all of them. (``VERL_USE_EXTERNAL_MODULES=
lockstep.rl.verl_plugin`` does the same without the entry point.)
"""

from lockstep.rl.verl import register

register()
