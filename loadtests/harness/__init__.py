"""What the HTTP benchmarks share, and the tests' server helper with them: a server process on
a loopback port (`server`), PostgreSQL and Redis scratch space (`services`), the open-loop load
generator (`load`), the CPU meter (`cpu`), and the gateway bench's step summary and report
(`report`)."""
