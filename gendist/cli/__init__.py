"""`python -m gendist COMMAND ...`: the command line, one module a command.

    main      the commands, `main`, and how a mistake becomes one line and exit code 2
    args      the one way a command line is parsed: a frozen dataclass a command, read by
              tyro (`parse`); `--preset NAME` / `--config FILE` pick a Config's defaults
    train     train (resume, fine-tune with --init-from), then a sample
    generate  sample from a run, a Hugging Face directory or a preset's random weights,
              through the decode front door (`gendist.inference.decoder`)
    prepare   a corpus into token files
    export    a run as a Hugging Face Llama directory
    plan      predicted vs compiled memory and communication for a config
    launch    N local processes of one multi-process job
"""
