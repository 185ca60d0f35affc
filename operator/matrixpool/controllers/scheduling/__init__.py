"""The scheduling cycle: keeps the pods of every gang in existence, places whole gangs onto
cards, preempts lower priorities, binds, and writes each workload's status.
"""
