"""Trainers: TRL's ``GRPOTrainer`` (:mod:`.trl`), verl's fused LM head (:mod:`.verl`) and
FSDP2-sharded models (:mod:`.fsdp`). Each is imported on its own: :mod:`.trl` needs TRL."""
