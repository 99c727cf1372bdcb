"""The compile report: `collect` (what `k3c compile --report` keeps in the artifact), `html` + `plots` (the page)."""
