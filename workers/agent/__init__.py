"""Trajectories and tool use: the one trajectory model (``pieces``, its row: ``piece_rows``), the
tool-call format, the environments that answer calls and how an answer is made (``observe``),
the sandbox."""
