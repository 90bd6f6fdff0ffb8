"""``detproxy diagnose``: the one-switch-at-a-time isolation of a serving recipe, as a CI gate.

Per prompt, greedy with logprobs: a prefill probe at batch 1, serial cold replays (intrinsic),
the same beside concurrent fillers (batch), cold against warm (prefix_cache), against a
reference upstream (speculative, or another recipe difference), and the upstream's identity
before and after (recipe_change). ``engine`` says how to run cold, ``experiments`` runs them,
``verdicts`` decides (pure), ``render`` prints, ``cli`` is the command.
"""
