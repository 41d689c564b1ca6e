"""The library API: sources, checks, stages (`convert`, `build`, `deploy`), `serve`, `client`, `verify`,
`loadtest`, `tune`, manifests and the client contract. `specbuild.pipeline.<module>` is `pipeline/<module>.py`."""
