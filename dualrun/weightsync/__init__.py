"""The trainer's weights into separate vLLM engines, both sides in one place: the wire both ends share (`wire`),
the trainer side (`trainer/`: TRL's client, the async trainer's transfer, regrouping after a replica change), the
engine side (`engine/`: the weight-transfer engine vLLM loads, and its plugin), the group a job forms (`group`:
pure) and `dualrun check`'s rehearsal of it (`rehearsal`, `probe`), built on the same group opening."""
