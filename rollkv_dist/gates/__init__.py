"""The GPU gates: each gate is a module of this package with a GATE (base.py says what it holds).

runner.py runs them, command.py is `rollkv gates`; context.py, process.py, llama_server.py, bench.py and
sizing.py are what the gates share; logparse.py reads the engine's lines, report.py writes the reports.
"""
