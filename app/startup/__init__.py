"""What runs before the window exists.

Choosing and checking the data folder, and the single-instance lock that brings an already
running window forward.
"""
