"""Human annotation of render pairs, for the feedback-alignment stage: a local web page where
people judge two renders of the same speech, a SQLite store of their choices, and the export of
preference pairs for Diffusion-DPO (the commands: cli.py). A package of its own, beside the live
server rather than in it, and below training: it reads a pairs folder and writes JSON lines."""
