"""DSpark draft training by self-distillation (`python -m sgl_dspark.tools.train_dspark_draft`):
the target's own continuations (`data`), the draft's context features taken from the serving
model runner's taps (`features`), the draft's differentiable block forward and the DSpark
objective (`objective`), the optimisation loop with resumable checkpoints (`trainer`), and the
acceptance measured with the serving engine (`evaluate`)."""
