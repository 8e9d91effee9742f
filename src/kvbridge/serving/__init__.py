"""What a user runs: the `kvbridge` command (`cli`), the PD proxy (`proxy`), `kvbridge serve` (`serve`), the
server launcher that serve, the demo and the tests share (`launcher`), and the demo with its tiny model builder
(`demo`, `tiny_model`).

The top floor: may use every layer below.
"""
