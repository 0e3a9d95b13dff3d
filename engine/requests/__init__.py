"""Requests between the caller's threads and the engine thread: validation at the door,
the inbox of messages the engine thread applies, and admission (a request becomes its
sequences, prompt encoded, keys drawn).
"""
