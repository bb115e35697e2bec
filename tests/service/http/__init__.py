"""Tests of service/http/: the protocol, direct answers, the fast routes and the middlewares."""
