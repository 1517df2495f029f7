"""The dataset key: the input files' sizes and times as Spark listed them
(``cache_key._file_metadata``), and the Spark Connect half (``connect_plan``), on plan
messages built by hand; tests/test_connect.py checks that against a real Connect server."""

import pytest

pb = pytest.importorskip("pyspark.sql.connect.proto", reason="needs pyspark's Connect client")

from spark_estimator.driver.connect_plan import normalize, plan_digest, sources  # noqa: E402


def attribute(name, plan_id=None):
    attr = pb.Expression.UnresolvedAttribute(unparsed_identifier=name)
    if plan_id is not None:
        attr.plan_id = plan_id
    expr = pb.Expression(unresolved_attribute=attr)
    expr.common.origin.python_origin.fragment = "col"
    expr.common.origin.python_origin.call_site = f"/home/me/train.py:{plan_id}"
    return expr


def range_plan(first_id, end=10, column="id"):
    """select(df[column]) over range(end), plan ids counted from ``first_id``."""
    source = pb.Relation(range=pb.Range(start=0, end=end, step=1))
    source.common.plan_id = first_id
    project = pb.Relation(
        project=pb.Project(input=source, expressions=[attribute(column, first_id)])
    )
    project.common.plan_id = first_id + 1
    return pb.Plan(root=project)


def parquet_read(path, **options):
    read = pb.Read(data_source=pb.Read.DataSource(format="parquet", paths=[path], options=options))
    return pb.Relation(read=read)


def test_the_same_query_built_again_has_the_same_digest():
    # plan ids come from a per-process counter; call sites name the user's file and line
    assert plan_digest(range_plan(0)) == plan_digest(range_plan(57))


def test_a_different_query_has_a_different_digest():
    base = plan_digest(range_plan(0))
    assert plan_digest(range_plan(0, end=11)) != base
    assert plan_digest(range_plan(0, column="other")) != base


def test_plan_ids_keep_which_relation_a_column_refers_to():
    def join(left_ref):
        left, right = range_plan(10).root, range_plan(20).root
        cond = pb.Expression(
            unresolved_attribute=pb.Expression.UnresolvedAttribute(
                unparsed_identifier="id", plan_id=left_ref
            )
        )
        return pb.Plan(root=pb.Relation(join=pb.Join(left=left, right=right, join_condition=cond)))

    assert plan_digest(join(11)) == plan_digest(join(11))
    assert plan_digest(join(11)) != plan_digest(join(21))  # df1["id"] vs df2["id"]


def test_normalize_drops_origins_and_renumbers_in_place():
    plan = range_plan(41)
    normalize(plan)
    assert plan.root.common.plan_id == 0
    assert plan.root.project.input.common.plan_id == 1
    assert plan.root.project.expressions[0].unresolved_attribute.plan_id == 1
    assert not plan.root.project.expressions[0].common.HasField("origin")


def test_read_options_are_part_of_the_digest():
    a = pb.Plan(root=parquet_read("/data/x", mergeSchema="true"))
    b = pb.Plan(root=parquet_read("/data/x", mergeSchema="false"))
    assert plan_digest(a) != plan_digest(b)


def test_sources_are_the_relations_without_children():
    table = pb.Relation(read=pb.Read(named_table=pb.Read.NamedTable(unparsed_identifier="t")))
    jdbc = pb.Relation(read=pb.Read(data_source=pb.Read.DataSource(format="jdbc")))
    union = pb.Relation(set_op=pb.SetOperation(left_input=parquet_read("/d"), right_input=table))
    assert sources(range_plan(0)) == ["range"]
    assert sorted(sources(pb.Plan(root=union))) == ["read.files", "read.named_table"]
    assert sources(pb.Plan(root=jdbc)) == ["read.data_source"]
    local = pb.Relation(local_relation=pb.LocalRelation(data=b"rows"))
    sql = pb.Relation(sql=pb.SQL(query="select 1"))
    assert sources(pb.Plan(root=local)) == ["local_relation"]
    assert sources(pb.Plan(root=sql)) == ["sql"]


def test_input_files_come_from_sparks_listing_as_hadoop_states_them(spark, tmp_path):
    """One JVM call per file source instead of a dozen per file (a folder of images), and
    the same [path, size, modification time] as Hadoop's status of each file."""
    from spark_estimator.driver.cache_key import _file_metadata, _leaves, _listed, _same_file

    for i in range(30):
        (tmp_path / f"{i}.bin").write_bytes(bytes(range(i % 7 + 1)) * (i + 1))
    df = spark.read.format("binaryFile").load(str(tmp_path))
    leaves = _leaves(df._jdf.queryExecution().analyzed())
    listed = _file_metadata(df, leaves)
    one_by_one = _file_metadata(df, [])  # nothing listed: Hadoop's status of each file
    assert listed == one_by_one and len(listed) == 30
    assert {_same_file(f) for f in df.inputFiles()} == set(_listed(leaves))  # all listed
    assert listed[0][0] == sorted(df.inputFiles())[0] and listed[0][1] > 0
