"""The host machine's own tools, beside a run rather than part of it: a warm python for short jobs started by the
dozen (the suite, the lab, the plan's probe), the compiler torch's extensions build with, and `make setup`'s
installer."""
