"""Training: one train-step builder and what runs around it.

    train       `build(cfg, mesh)`: state, the jitted step and eval, the non-finite guard
    gradients   loss and gradient engines: plain autodiff, pipeline schedules, TeraPipe,
                PipeDream (chosen by the config)
    optim       the optimizer (optax) and its ZeRO placement
    checks      a config checked against the mesh and the model before anything compiles
    loop        `run(cfg)`: data, steps, evaluation, checkpoints, metrics, resumption
    checkpoint  atomic orbax checkpoints; serialize: parameters read back from a run
"""
