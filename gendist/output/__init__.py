"""What a run leaves behind and prints.

    console       progress bars, log lines, what only process 0 prints
    report        the header and footer a run prints
    rundir        a run directory belongs to one config (resume, refuse a different one)
    wandb_logger  optional Weights & Biases logging
"""
