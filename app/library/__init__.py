"""The chat library as the window shows it.

The sidebar (chats, folders, the filter), folder moves, search results, and the
export/import dialogs with the flows that run them. Persistence and search themselves are in
app/core (no Qt).
"""
