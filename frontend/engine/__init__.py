"""The frontend's side of the scheduler: the ZMQ engine client (admission, recovery after a
scheduler restart), one HTTP request's engine requests as they stream, and the client of
the scheduler's HTTP port."""
