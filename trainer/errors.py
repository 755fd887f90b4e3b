"""A problem with the job that the submitter can fix; the message says how."""


class JobError(Exception):
    pass
