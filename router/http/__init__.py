"""The router's HTTP edge: the ASGI application (`app`), the admin API that controllers declare
pools through (`admin`), the models remembered across restarts (`remembered`), and the uvicorn
server (`server`) that `python -m router` runs.
"""
